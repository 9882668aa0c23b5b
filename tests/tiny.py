"""The smallest run the CLI tests start: a random 2-layer llama, 2 prompts x 2 samples, an evicting cache of 24."""

TINY_RUN = [
    "model.spec=tiny-llama",
    "rollout.prompts_per_step=2",
    "rollout.n=2",
    "kv.budget=24",
    "kv.interval=4",
]
