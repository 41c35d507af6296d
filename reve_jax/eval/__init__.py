"""Quality metrics that need no downloaded weights (caption alignment, a Fréchet distance in a self-trained
feature space, held-out v-loss; FD-DINOv2 given converted weights) and the speedup benchmark built on them."""

from reve_jax.eval.quality import Evaluator, evaluate

__all__ = ["Evaluator", "evaluate"]
