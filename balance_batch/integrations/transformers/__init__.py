"""Hugging Face transformers: the Trainer on the sampler's steps (``TokenBudgetTrainer``) and the model preparation
packed rows need (``prepare_model_for_packing``). Importing this imports transformers and torch."""
