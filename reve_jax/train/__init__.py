"""Training: the run builder, the one loop and its hooks, the train state and step, the objective, the
trainer that ties them to a workdir, and sampling."""
