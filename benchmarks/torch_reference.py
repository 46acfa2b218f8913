"""The torch side of the benchmarks: `transformers` `generate`, in this process or another one.

Torch is never a jaxreplay requirement, and the default tier may have none (no CPU torch
wheel for its Python here). The reference then runs under another interpreter that has
torch and transformers (`--torch-python`, e.g. the Reverb lane's `.venv-reverb/bin/python`),
serving one JSON request per line on stdin:

    python -m benchmarks.torch_reference serve

so the benchmark still times our sampler and `generate` alternately, in one run, on the
same weights: the reference writes the random model directory, our HF bridge loads it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def write_qwen2(path: Path, s: dict, dtype: str = "float32") -> None:
    """A random Qwen2 model directory written by transformers itself."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=s["vocab"], hidden_size=s["width"], intermediate_size=s["d_ff"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(str(path))


def write_gemma3(path: Path, s: dict, dtype: str = "float32") -> None:
    """A random Gemma 3 (text) model directory written by transformers itself: local and global layers
    alternating, a sliding window of `s["window"]` (shorter than the prompt plus completion)."""
    import torch
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=s["vocab"], hidden_size=s["width"], intermediate_size=s["d_ff"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["width"] // s["heads"],
        query_pre_attn_scalar=s["width"] // s["heads"], sliding_window=s["window"], sliding_window_pattern=2,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(str(path))


def write_qwen3_moe(path: Path, s: dict, dtype: str = "float32") -> None:
    """A random Qwen3-MoE model directory written by transformers itself: every layer sparse, `s["experts"]`
    experts of which each token takes 2 (normalised, as Qwen3-30B-A3B), each expert half the dense `d_ff`,
    so a token's active MLP has the dense model's parameters."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=s["vocab"], hidden_size=s["width"], intermediate_size=s["d_ff"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["width"] // s["heads"],
        moe_intermediate_size=s["d_ff"] // 2, num_experts=s["experts"], num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(str(path))


WRITERS = {"qwen2": write_qwen2, "gemma3": write_gemma3, "qwen3_moe": write_qwen3_moe}


def generate_fn(hf, tokens: np.ndarray, mask: np.ndarray, new_tokens: int, device: str = "cpu"):
    """`transformers` sampling of exactly `new_tokens` tokens at temperature 1, as a thunk."""
    import torch

    ids = torch.from_numpy(tokens.astype(np.int64)).to(device)
    att = torch.from_numpy(mask.astype(np.int64)).to(device)

    def generate():
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=att, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        if device != "cpu":
            torch.cuda.synchronize()
        return out

    return generate


class LocalReference:
    """`generate` timed in this process."""

    def __init__(self):
        self._models: dict[str, object] = {}

    def write_model(self, path: str, spec: dict) -> dict:
        WRITERS[spec.get("family", "qwen2")](Path(path), spec)
        return {"ok": True}

    def time_generate(self, path: str, tokens: np.ndarray, mask: np.ndarray, new_tokens: int, repeats: int) -> dict:
        """Best seconds of `repeats` runs after a warm-up, at the better of 1 thread and
        torch's default (which can lose badly to one thread on a busy machine)."""
        import torch
        import transformers

        if path not in self._models:
            self._models[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        generate = generate_fn(self._models[path], tokens, mask, new_tokens)
        out = generate()  # warm-up; also checks the shape
        assert tuple(out.shape) == (tokens.shape[0], tokens.shape[1] + new_tokens), out.shape
        default_threads = torch.get_num_threads()
        timed = []
        for t in sorted({1, default_threads}):
            torch.set_num_threads(t)
            timed.append((best_time(generate, 1), t))
        seconds, threads = min(timed)
        torch.set_num_threads(threads)
        seconds = min([seconds] + [best_time(generate, 1) for _ in range(repeats - 1)])
        torch.set_num_threads(default_threads)
        return {"seconds": seconds, "threads": threads, "torch": torch.__version__,
                "python": sys.version.split()[0]}

    def close(self) -> None:
        self._models.clear()


class RemoteReference:
    """The same calls, answered by `serve` under another interpreter."""

    def __init__(self, python: str, timeout_s: float = 600.0):
        self.python = python
        self.timeout_s = timeout_s
        self._proc = subprocess.Popen([python, "-m", "benchmarks.torch_reference", "serve"], cwd=ROOT,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _call(self, **request) -> dict:
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the torch reference under {self.python} exited (code {self._proc.wait(10)})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"torch reference under {self.python}: {answer['error']}")
        return answer

    def write_model(self, path: str, spec: dict) -> dict:
        return self._call(op="write_model", path=path, spec=spec)

    def time_generate(self, path: str, tokens: np.ndarray, mask: np.ndarray, new_tokens: int, repeats: int) -> dict:
        return self._call(op="time_generate", path=path, tokens=tokens.tolist(), mask=mask.tolist(),
                          new_tokens=new_tokens, repeats=repeats)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def has_torch(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import torch, transformers"], capture_output=True, timeout=120)
    return probe.returncode == 0


def torch_python(requested: Optional[str] = None) -> Optional[str]:
    """The interpreter for the reference: `requested`, else this one if it has torch, else the
    Reverb lane's venv if it has; None when there is none."""
    if requested:
        return requested
    candidates = [sys.executable, str(ROOT / ".venv-reverb" / "bin" / "python")]
    return next((p for p in candidates if Path(p).exists() and has_torch(p)), None)


def reference(python: str):
    """A LocalReference when `python` is this interpreter, else a RemoteReference."""
    return LocalReference() if Path(python).absolute() == Path(sys.executable).absolute() else RemoteReference(python)


def serve() -> None:
    local = LocalReference()
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            if op == "time_generate":
                request["tokens"] = np.asarray(request["tokens"], np.int32)
                request["mask"] = np.asarray(request["mask"], bool)
            answer = getattr(local, op)(**request)
        except Exception as e:  # noqa: BLE001 - reported to the caller, which raises it
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
