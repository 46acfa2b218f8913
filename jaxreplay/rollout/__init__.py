"""Generating rollouts: the sampler (prefill + KV-cache decode), the actor that scores them and
freezes their group advantages, and the rollout row every stage after it reads."""
