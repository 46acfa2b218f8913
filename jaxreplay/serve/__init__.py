"""The policy behind an HTTP endpoint: OpenAI completions and chat (streaming, tools, log-probs)
and vLLM's token-in/token-out route, served by the rollout engine on one engine thread."""
