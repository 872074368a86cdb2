"""Tools that open a run directory: restoring a run's model and config, generation, evaluation, reward
scoring, chat rendering, and writing Hugging Face / PEFT directories (`train.export`, `train.adapters`)."""
