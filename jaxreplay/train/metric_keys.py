"""Every key a run writes into metrics.jsonl (and TensorBoard, W&B), with what it means.

The keys are written by several modules (learn/losses.py, learn/learner.py, rollout/actor.py,
train/run.py, train/accounting.py); this registry is their one documented list. The docs' metrics
reference is generated from it (`python -m jaxreplay.tools.docgen`), and tests/test_train.py checks
that every key a real run writes is here. A new metric gets its line here.
"""

from __future__ import annotations

from jaxreplay.learn.staleness import AGE_BUCKETS, STATS, key as by_age_key

# (key, meaning, when it is written). Groups in the order the docs list them.
METRICS: tuple[tuple[str, str, str], ...] = (
    ("step", "learner step of the record; step 0 holds the warm-start evaluation", "every record"),
    # The update (learn/learner.py, learn/losses.py).
    ("loss", "total loss of the update", "every step"),
    ("pg_loss", "the policy-gradient part of the loss", "every step"),
    ("entropy", "token-mean entropy on the training batch of the distribution the actor samples from: softmax at "
                "`sampling.temperature`, truncated to `sampling.top_k` / `sampling.top_p` and renormalised (with both "
                "off, the full softmax's)", "every step"),
    ("pg_clipfrac", "share of tokens where PPO clipping is active", "`train.loss: grpo`, `grpo_tis`, `seq_mask`, `decoupled`"),
    ("pg_clipfrac_low", "share of tokens with ratio < 1 - eps_low and A < 0", "`train.loss: grpo`"),
    ("pg_clipfrac_high", "share of tokens with ratio > 1 + eps_high and A > 0", "`train.loss: grpo`"),
    ("tis_truncfrac", "share of tokens whose ratio the `tis` loss caps at `train.tis_cap` (`grpo_tis`: whose "
                      "π_prox/π_behaviour it caps)", "`train.loss: tis` or `grpo_tis`"),
    ("is_weight_mean", "mean importance weight π_prox/π_behaviour the loss multiplies by (`grpo_tis`: truncated at "
                       "`train.tis_cap`; `decoupled`: 0 on the dropped tokens)", "`train.loss: grpo_tis` or `decoupled`"),
    ("seq_mask_frac", "share of tokens in rows the `seq_mask` loss drops (geometric-mean ratio outside "
                      "[`train.seq_mask_low`, `train.seq_mask_high`])", "`train.loss: seq_mask`"),
    ("m2po_masked_frac", "share of tokens the `m2po` loss masks to bring the second moment under "
                         "`train.m2po_threshold`", "`train.loss: m2po`"),
    ("m2po_m2", "mean squared log-ratio log(π_θ/π_behaviour)² of the batch's tokens, before masking",
     "`train.loss: m2po`"),
    ("decoupled_masked_frac", "share of tokens the `decoupled` loss drops (weight above `train.decoupled_weight_cap`)",
     "`train.loss: decoupled`"),
    ("approx_kl", "k3 estimate of KL(behaviour ‖ current): mean of r − 1 − log r with r = π_current/π_behaviour over "
                  "the batch's tokens (drawn from the behaviour policy); drift since generation", "every step"),
    ("ratio_mean", "mean ratio π_current/π_behaviour over the batch's tokens", "every step"),
    ("kl_ref", "KL to the warm-start policy", "`train.kl_coef` > 0"),
    ("router_aux_loss", "mixture of experts: the routers' load-balancing loss on the training batch, as HF's "
                              "`load_balancing_loss_func` (before `model.router_aux_loss_coef`)",
     "`model.n_experts` > 0"),
    ("router_disagreement", "mixture of experts: share of the training batch's (token, sparse layer) pairs whose top-k "
                            "experts under the learner's router differ from those the sampler chose (recorded on the "
                            "row); with `train.routing_replay` the learner routes as the sampler did all the same",
     "`model.n_experts` > 0 with `sampling.engine: static`"),
    ("grad_norm", "global gradient norm before clipping", "every step"),
    ("learning_rate", "the learning rate this update applied (it warms up over `train.warmup_steps`)", "every step"),
    ("nonfinite", "1 if this step's loss, gradient or update was not finite and the update was skipped",
     "every step"),
    ("train/nonfinite_steps", "how many updates were skipped as non-finite so far", "every step"),
    # The latest actor batch (rollout/actor.py, train/run.py).
    ("reward_mean", "mean reward of the latest actor batch (fresh rollouts)", "every step"),
    ("reward_std", "reward standard deviation of the latest actor batch", "every step"),
    ("accuracy", "share of the latest actor batch's rollouts with reward 1", "every step"),
    ("completion_length", "mean completion length (tokens) of the latest actor batch", "every step"),
    ("reward/errors", "reward calls of the latest actor batch that raised (scored 0 and logged, not fatal)",
     "every step"),
    ("episode/turns", "multi-turn: mean model turns per episode of the latest actor batch", "`environment.name` set"),
    ("episode/truncated", "multi-turn: share of the latest actor batch's episodes cut by `environment.max_turns` or "
                          "`sampling.max_new_tokens`", "`environment.name` set"),
    ("env/errors/exception", "multi-turn: environment calls of the latest actor batch's episodes that raised (the "
                             "episode ends); a snapshot of that batch only, the run's total is "
                             "`env/errors_total/exception`", "`environment.name` set"),
    ("env/errors/timeout", "multi-turn: environment calls of the latest actor batch's episodes past "
                           "`environment.step_timeout_s` (the episode ends); that batch only", "`environment.name` set"),
    ("env/errors/malformed_tool_call", "multi-turn: turns of the latest actor batch's episodes the environment "
                                       "answered with info error `malformed_tool_call`; that batch only",
     "`environment.name` set"),
    ("env/errors/unencodable_observation", "multi-turn: observations of the latest actor batch's episodes the chat "
                                           "format could not render or the tokenizer could not encode, or a first "
                                           "one wider than `task.max_prompt_len` (the episode ends; at reset, every "
                                           "episode of the group); that batch only",
     "`environment.name` set"),
    ("env/errors/rerendered_prompt", "agent-loop episodes (`environment.name: agent_loop`): calls of the latest "
                                     "actor batch's episodes refused with a 409 because their prompt did not extend "
                                     "the episode's earlier ids (the client re-rendered earlier turns; the episode "
                                     "goes on); that batch only", "`environment.name` set"),
    ("env/errors_total/exception", "multi-turn: cumulative `env/errors/exception` over the run, every actor batch "
                                   "counted once (resumes included; also in summary.json)", "`environment.name` set"),
    ("env/errors_total/timeout", "multi-turn: cumulative `env/errors/timeout` over the run", "`environment.name` set"),
    ("env/errors_total/malformed_tool_call", "multi-turn: cumulative `env/errors/malformed_tool_call` over the run",
     "`environment.name` set"),
    ("env/errors_total/unencodable_observation", "multi-turn: cumulative `env/errors/unencodable_observation` over "
                                                 "the run", "`environment.name` set"),
    ("env/errors_total/rerendered_prompt", "agent-loop episodes: cumulative `env/errors/rerendered_prompt` over the "
                                           "run", "`environment.name` set"),
    # The sampled training batch (train/run.py).
    ("batch/reward_mean", "mean reward of the sampled (possibly replayed) training batch", "every step"),
    ("batch/version_min", "oldest policy version that generated a row of the batch", "every step"),
    ("batch/version_max", "newest policy version that generated a row of the batch", "every step"),
    ("staleness/mean", "mean of learner policy version minus the version that generated each sampled row",
     "every step"),
    ("staleness/max", "largest such staleness in the batch", "every step"),
    ("staleness/hist", "counts of the batch's staleness in bins 0, 1, 2-3, 4-7, ..., 256+", "every step"),
    # Staleness by age (learn/staleness.py): the batch's rows by age (learner version − policy_version), from the
    # forward pass the loss used; a bucket with no row is left out of the record.
    *((by_age_key(bucket, stat), f"rows {bucket} versions old: {meaning}", "every step, for ages in the batch")
      for bucket in AGE_BUCKETS for stat, meaning in STATS.items()),
    ("policy_version", "learner updates so far (the actor uses the latest in colocated mode)", "every step"),
    ("weights/version_at_actor", "the policy version the actor samples with (disaggregated: the last pushed)",
     "every step"),
    # The replay table (train/run.py, train/accounting.py).
    ("replay/size", "rows in the rollout table", "every step"),
    ("replay/inserts", "cumulative rows inserted into the rollout table", "every step"),
    ("replay/samples", "cumulative rows sampled from the rollout table", "every step"),
    ("replay/ratio", "measured samples / inserts (the replay ratio) of the rollout table; with "
                     "`replay.positive_fraction` > 0 its target is spi·B_main/B, the positives table supplying the rest",
     "every step"),
    ("replay/times_sampled_mean", "how often the sampled rows had been sampled, this time included", "every step"),
    ("replay/times_sampled_hist", "counts of the batch's times-sampled in bins 1, 2, 3, 4-5, 6-7, 8-11, 12-15, "
                                  "16-31, 32+", "every step"),
    ("replay/never_sampled_frac", "share of generated rollouts not trained on (yet): 1 − rollouts sampled at least "
                                  "once / rollouts generated, by `rollout_id` (a rollout in two tables counts once; "
                                  "dropped groups count as never sampled)", "every step"),
    ("replay/dropped_groups", "cumulative groups dropped at insert (`replay.drop_zero_advantage_groups`)",
     "every step"),
    ("replay/evicted", "cumulative rows evicted as too old (`replay.max_age`, every table's)", "every step"),
    # Budgets and cost (train/run.py, train/accounting.py).
    ("tokens/generated", "cumulative completion tokens generated", "every step"),
    ("tokens/trained", "cumulative completion tokens trained on", "every step"),
    ("rollouts/generated", "cumulative rollouts generated", "every step"),
    ("rollouts/trained", "cumulative rollouts trained on; the report's modelled compute is trained + mu × generated",
     "every step"),
    ("rollouts/waiting_max", "the most scored rollouts waiting for the table since the previous record (the "
                             "engine's backpressure bound caps it)", "`sampling.engine: continuous`"),
    ("engine/groups_in_flight", "prompt groups in the engine's slot pool at the record's checkpoint position "
                                "(regenerated on resume)", "`sampling.engine: continuous`"),
    ("time/generate_s", "cumulative seconds in generation", "every step"),
    ("time/train_s", "cumulative seconds in the jitted update", "every step"),
    ("time/replay_s", "cumulative seconds in replay calls (limiter queries, inserts, samples, checkpoints)",
     "every step"),
    ("time/generate_timed_s", "cumulative generation seconds behind `cost/generate_s_per_rollout` (each process's "
                              "first, compiling call left out): the report's wall-clock axis", "every step"),
    ("time/train_timed_s", "cumulative update seconds behind `cost/train_s_per_rollout` (first call left out)",
     "every step"),
    ("cost/generate_s_per_rollout", "measured seconds to generate a rollout, the first (compiling) call left out",
     "every step"),
    ("cost/train_s_per_rollout", "measured seconds to train on a rollout, the first (compiling) call left out",
     "every step"),
    ("cost/mu", "their ratio: the cost of generating a rollout relative to training on it, estimated online",
     "every step"),
    ("compute/flops_generate", "cumulative FLOP estimate of generation: 2 × params per token (prefill + decode)",
     "every step"),
    ("compute/flops_train", "cumulative FLOP estimate of training: 6 × params per token trained", "every step"),
    ("compute/flops", "their sum", "every step"),
    # Evaluation (train/run.py, train/driver.py).
    ("eval/accuracy", "greedy exact-match accuracy on the test split (the held-out set)",
     "step 0, every `train.eval_every` steps (or `train.eval_every_tokens`), the last step"),
    ("eval/validation_accuracy", "greedy exact-match accuracy on the validation split (`task.validation_size` > 0; "
     "multi-turn: the success rate of one greedy episode per validation item): what learning rates are chosen on",
     "with eval/accuracy"),
    ("eval/turns", "multi-turn: mean model turns per greedy evaluation episode (eval/accuracy is their success "
                   "rate: reward 1)", "with eval/accuracy, `environment.name` set"),
)

KEYS = frozenset(key for key, _, _ in METRICS)
