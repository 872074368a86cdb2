"""The CPU MoE recipe: tiny's model with every feed-forward a top-2-of-8 Mixture of Experts, each expert 96 wide
(192 active hidden units per token, half of tiny's 384-wide MLP; `tiny` with model.mlp_dim=192 is the dense model
with the same active parameters). Trained like tiny (300 steps of 16 x 128 tokens on the built-in corpus).
"""
from configs import tiny


def get_config():
  c = tiny.get_config()
  c.model.update(num_experts=8, experts_per_token=2, expert_mlp_dim=96, moe_impl="tiled")
  return c
