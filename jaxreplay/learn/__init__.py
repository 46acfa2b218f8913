"""Learning from sampled rollouts: the jitted policy update, the per-token scoring, the losses."""
