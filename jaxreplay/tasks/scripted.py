"""A scripted player's episodes as supervised rows: the multi-turn tasks' warm starts.

A warm start imitates a player's turns, never the environment's answers: each row is the prompt,
then the player's turns (each ended by EOS, in the loss mask) and the environment's answers (in
the attention mask only) interleaved, as an episode's row is laid out for the learner.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxreplay.tasks.arithmetic import CharTokenizer

Episode = Sequence[tuple[str, str]]  # [(the player's turn, the environment's answer)], the last answer ""


def episode_rows(tokenizer: CharTokenizer, prompts: np.ndarray, prompt_mask: np.ndarray,
                 episodes: Sequence[Episode], max_new_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, attention mask, loss mask), each [n, P + max_new_tokens], of `episodes` after their
    encoded prompts [n, P]; an episode longer than `max_new_tokens` is cut there."""
    n = len(episodes)
    body = np.full((n, max_new_tokens), tokenizer.PAD, np.int32)
    body_mask = np.zeros((n, max_new_tokens), bool)
    loss = np.zeros((n, max_new_tokens), bool)
    for i, episode in enumerate(episodes):
        col = 0
        for turn, answer in episode:
            for ids, trained in ((tokenizer.encode(turn) + [tokenizer.EOS], True), (tokenizer.encode(answer), False)):
                ids = ids[:max_new_tokens - col]
                body[i, col:col + len(ids)] = ids
                body_mask[i, col:col + len(ids)] = True
                loss[i, col:col + len(ids)] = trained
                col += len(ids)
    return (np.concatenate([prompts, body], axis=1), np.concatenate([prompt_mask, body_mask], axis=1),
            np.concatenate([np.zeros_like(prompt_mask), loss], axis=1))
