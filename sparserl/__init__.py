"""sparserl: RL for language models with rollouts on a sparse KV cache."""

__version__ = "0.1.0"
