"""The stream side: message v1, Redis keys and connections, the producer client."""
