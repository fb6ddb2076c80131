"""Learning from a stream: the learner loop, the replay buffer, drift, evaluation."""
