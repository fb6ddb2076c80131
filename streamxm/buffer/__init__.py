"""The replay buffer of recent pairs (and the class-balanced memory beside it) that the models
draw triplets, partners and rehearsal from."""
