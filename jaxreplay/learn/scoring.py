"""Per-token log-probs and entropy of whole sequences, a chunk of positions at a time.

The learner needs, at every position t, the log-prob of tokens[t] under the policy's
distribution computed at t - 1, and that distribution's entropy. Computed at once,
that is a [B, T, V] float32 array, and autodiff keeps it for the backward pass: for
the 7B config 60 x 2,560 x 152,064 x 4 bytes = 93 GB. Here the final hidden states
are unembedded `chunk` positions at a time inside a rematerialised `lax.map`, so one
chunk's logits exist at a time, in the forward pass and again in the backward pass;
what the scan keeps per chunk is its hidden states and targets. The log-probs are those
of `sampling.policy_logprobs` on the full logits; the entropy is `sampling_entropy`'s,
that of the distribution the actor samples from.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxreplay.rollout.sampling import filter_logits, picked_logprobs

Unembed = Callable[[jax.Array], jax.Array]  # hidden [B, c, D] -> float32 logits [B, c, V]


def sampling_entropy(logits: jax.Array, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                     live_vocab: int = 0) -> jax.Array:
    """[...]: entropy of the distribution the actor samples from at `logits` [..., V]:
    softmax(logits / temperature) truncated to top-k / top-p and renormalised
    (`sampling.filter_logits`). With both filters off, that of softmax(logits / temperature).
    Reporting the full softmax's entropy instead would count mass the actor never draws."""
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, live_vocab=live_vocab)
    logp = jax.nn.log_softmax(filtered, axis=-1)
    logp = jnp.where(jnp.isfinite(filtered), logp, 0.0)  # a dropped token's p = 0 adds 0, not 0 * -inf
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def sequence_scores(h: jax.Array, tokens: jax.Array, unembed: Unembed, *, temperature: float, top_k: int = 0,
                    top_p: float = 1.0, chunk: int = 0, with_entropy: bool = True,
                    live_vocab: int = 0) -> tuple[jax.Array, Optional[jax.Array]]:
    """(log-probs [B, T], entropy [B, T] or None): entry t scores tokens[t] under the
    distribution from h[:, t - 1]; entry 0 is 0. The log-probs are under the sampling
    distribution (temperature, top-k, top-p), and so is the entropy (`sampling_entropy`),
    which carries no gradient. `chunk` positions are unembedded at a time
    (0: all at once, as `forward` does). Ids from `live_vocab` on (the embedding's padding)
    have probability 0, as in the sampler (0: every id)."""
    b, t, d = h.shape
    n = t - 1
    h, targets = h[:, :-1], tokens[:, 1:]

    def score(h_c, targets_c):
        logits = unembed(h_c)
        lp = picked_logprobs(logits, targets_c, temperature=temperature, top_k=top_k, top_p=top_p,
                             live_vocab=live_vocab)
        ent = None
        if with_entropy:
            ent = sampling_entropy(jax.lax.stop_gradient(logits), temperature=temperature, top_k=top_k, top_p=top_p,
                                   live_vocab=live_vocab)
        return lp, ent

    if chunk <= 0 or n == 0:
        lp, ent = score(h, targets)
    else:
        size = min(chunk, n)
        count = -(-n // size)
        pad = count * size - n
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, count, size, d).swapaxes(0, 1)
        targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, count, size).swapaxes(0, 1)
        lp, ent = jax.lax.map(lambda xs: jax.checkpoint(score)(*xs), (h, targets))
        unchunk = lambda x: x.swapaxes(0, 1).reshape(b, count * size)[:, :n]
        lp, ent = unchunk(lp), None if ent is None else unchunk(ent)
    shifted = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
    return shifted(lp), None if ent is None else shifted(ent)
