"""The one Trainer and its run: sharded state and the jitted step, optimizer, loss, checkpoints, logging and
profiling, evaluators, and the loop behind `python -m train` (pretraining and post-training)."""
