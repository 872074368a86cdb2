"""The model's lifecycle in one command: python -m train.lifecycle (runner.py), its report and model card."""
