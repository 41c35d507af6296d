"""Quality metrics of generated images and of a model: KID, the Fréchet distance, bootstrap intervals over
captions, held-out v-loss, the Evaluator that combines them on the synthetic dataset, and scoring a checkpoint."""
