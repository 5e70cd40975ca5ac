"""A Llama-family decoder end to end (examples/llm: Llama 3 shapes, random weights),
each contestant in a process of its own, run one after the other:

  q4torch   transformers + q4torch.hf.Q4Config("nf4"), bf16 compute (eager)
  q4torch+head   the same with Q4Config(quantize_head=True): the tied head in NF4 too
  q4torch+head+compile   the same, its decode step compiled (torch.compile(fullgraph=True),
            StaticCache; the compile time is reported apart)
  q4torch+head+w4a8   q4torch+head with Q4Config(activation_quant="int8"): W4A8, the inputs
            quantized to int8 per block as llama.cpp's Q4_0 path does (opt-in, ~1e-2 relative
            error; README "W4A8")
  q4jax     examples/llm/flax_llama.py over the same NF4 bytes, bf16, jitted decode step
  q4jax+head     the same over the quantize_head folder
  bnb       transformers + BitsAndBytesConfig(nf4, bf16), eval + inference_mode (its fused CPU path)
  bf16      transformers, dense bf16
  torchao   transformers bf16, then torchao 0.18's int4 weight-only on the CPU (quantize_ with
            IntxWeightOnlyConfig(int4, group 64): the CPU path its x86 wheel runs; its
            Int4WeightOnlyConfig needs the CUDA-only mslk, its packed CPU formats the low-bit
            ops the wheel does not ship); installed into the cache on first use
  llamacpp  llama.cpp (the PyPI llama-cpp-python) on a GGUF of the same weights, Q4_0 and Q4_K_M
            quantized by llama.cpp's own quantizer (benchmarks/llm_gguf.py; installed on first use)

For each: load time and the process's resident / peak memory after loading (and what the
load added to the resident memory of the process before it, against the weights held; and
the resident memory after the runs, once the decode has touched every page); prefill
tokens/s of a --prefill-token prompt (one forward); decode tokens/s at batch 1 after a
--prompt-token prompt (greedy, through the KV cache, --decode tokens, the median step)
and at batch 8. The decode floor is the bytes a token reads (the weights each contestant
holds, plus its float head) over the DRAM bandwidth measured in the same run; each
contestant's share of it is printed.

  python benchmarks/llm.py [--size tiny|1b|7b] [--contestants q4torch,q4jax,...]

Writes bench-results/llm-<size>.json. Never asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CONTESTANTS = (
    "q4torch", "q4torch+head", "q4torch+head+compile", "q4torch+head+w4a8", "q4jax", "q4jax+head", "bnb", "bf16", "torchao",
    "llamacpp-q4_0", "llamacpp-q4_k_m",
)  # fmt: skip
TORCHAO = "torchao==0.18.0"
CACHE = Path(os.environ.get("Q4_BENCH_CACHE", Path.home() / ".cache" / "q4-bench"))


def _rss() -> tuple[float, float, float]:
    """(resident, peak resident, resident anonymous) memory of this process in MB
    (VmRSS, VmHWM, RssAnon: the last leaves out file pages, such as a safetensors
    file mapped while loading, which the kernel drops under pressure)."""
    vals = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM", "RssAnon")):
            vals[line.split(":")[0]] = int(line.split()[1]) / 1024
    return vals.get("VmRSS", 0.0), vals.get("VmHWM", 0.0), vals.get("RssAnon", 0.0)


def _median_step(step, n: int) -> float:
    """Median seconds of one call of step() over n calls (each call decodes one token)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------ contestants (child processes)


def _torchao_path() -> Path:
    """torchao, pip-installed once into the cache (never into the project's venv: peft and
    transformers change their behaviour when it is importable)."""
    target = CACHE / TORCHAO.replace("==", "-")
    if not (target / "torchao").is_dir():
        print(f"installing {TORCHAO} into {target} (once) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), TORCHAO],
                       check=True)  # fmt: skip
    return target


def _held_bytes(tensors) -> int:
    """Bytes of distinct tensors (a tied head and its embedding counted once; a tensor
    subclass, such as torchao's, by the tensors it holds)."""
    seen: dict = {}

    def add(t):
        if type(t).__name__ not in ("Tensor", "Parameter") and hasattr(t, "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
        else:
            seen[(t.device.type, t.data_ptr(), t.numel())] = t.numel() * t.element_size()

    for t in tensors:
        add(t)
    return sum(seen.values())


_MATMUL_OPS = re.compile(r"gemm|gemv|matmul_4bit|dequantize|int8_linear|^aten::(mm|addmm|_weight_int4pack)")


def _matmul_ms(step, n: int = 3) -> float:
    """Milliseconds a decode step spends in the weight matmuls (q4's gemm, bitsandbytes'
    gemv / dequantize, torch's mm / addmm; attention is not one of them), from
    torch.profiler's self CPU time over n steps: the rest of the step is the model's own
    eager code."""
    from torch.profiler import ProfilerActivity, profile

    # q4torch's eager layers call the kernel directly (no dispatcher, so no profiler event):
    # that call is timed by a wrapper instead
    direct = [0.0]
    ops = sys.modules.get("q4torch._src.ops")
    call = getattr(ops, "gemm_4bit_call", None)
    if call is not None:

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                direct[0] += time.perf_counter() - t0

        ops.gemm_4bit_call = timed
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                step()
    finally:
        if call is not None:
            ops.gemm_4bit_call = call
    us = sum(e.self_cpu_time_total for e in prof.key_averages() if _MATMUL_OPS.search(e.key))
    return (us / 1e3 + direct[0] * 1e3) / n


def _torch_run(kind: str, folder: Path, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, DynamicCache, StaticCache

    torch.set_num_threads(args.threads)
    if kind == "torchao":
        sys.path.insert(0, str(_torchao_path()))
        from torchao.quantization import IntxWeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup
    rss0 = _rss()[0]
    t0 = time.perf_counter()
    if kind.startswith("q4torch"):
        import q4torch.hf

        qc = q4torch.hf.Q4Config(
            "nf4",
            compute_dtype=torch.bfloat16,
            quantize_head="+head" in kind,
            activation_quant="int8" if kind.endswith("+w4a8") else None,
        )
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=qc)
    elif kind == "bnb":
        qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=qc)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        if kind == "torchao":
            quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(64)))
    model.eval()
    load_s = time.perf_counter() - t0
    rss, peak, anon = _rss()
    weight_bytes = _held_bytes(model.state_dict().values())
    vocab = model.config.vocab_size
    rng = torch.Generator().manual_seed(0)
    out = {"load_s": load_s, "rss_mb": rss, "anon_mb": anon, "peak_mb": peak, "held_bytes": weight_bytes,
           "rss_before_mb": rss0}  # fmt: skip

    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (1, args.prefill), generator=rng)
        model(prompt)  # warm
        t0 = time.perf_counter()
        model(prompt)
        out["prefill_tok_s"] = args.prefill / (time.perf_counter() - t0)
        # "+compile": the decode step through torch.compile(fullgraph=True) over a StaticCache
        # (transformers' recipe for a compiled decode: fixed shapes, one graph per batch size,
        # the compile time reported apart); the prefill stays eager
        compiled = kind.endswith("+compile")
        forward = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
        for batch in (1, 8):
            prompt = torch.randint(0, vocab, (batch, args.prompt), generator=rng)
            if compiled:
                cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.decode + 8)
            else:
                cache = DynamicCache(config=model.config)
            logits = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1]
            state = {"tok": logits.argmax(-1, keepdim=True), "cache": cache, "pos": args.prompt}

            def step(state=state):
                pos = torch.tensor([state["pos"]])
                lg = forward(state["tok"], past_key_values=state["cache"], use_cache=True, cache_position=pos).logits
                state["tok"] = lg[:, -1].argmax(-1, keepdim=True)
                state["pos"] += 1

            t0 = time.perf_counter()
            step()
            if compiled:
                out[f"compile_b{batch}_s"] = time.perf_counter() - t0
            step()
            out[f"decode_b{batch}_tok_s"] = batch / _median_step(step, args.decode)
            if batch == 1 and not compiled:
                out["matmul_ms_b1"] = _matmul_ms(step)
    out["rss_end_mb"] = _rss()[0]
    if kind in ("q4torch", "bnb") and args.qlora:
        out["qlora_tok_s"] = _torch_qlora(model, kind, vocab, args)
    return out


def _torch_qlora(model, kind: str, vocab: int, args) -> float:
    """Tokens/s of one QLoRA step: peft LoRA r=16 on all seven projections, one
    sequence of --qlora tokens, forward + backward + AdamW (the median of 3 steps)."""
    import torch
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=16, lora_alpha=16, target_modules=targets)
    if kind == "q4torch":
        import q4torch.peft

        config = q4torch.peft.register(config)
    model = get_peft_model(model, config)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, vocab, (1, args.qlora), generator=torch.Generator().manual_seed(1))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return args.qlora / _median_step(step, 3)


def _jax_run(folder: Path, args) -> dict:
    os.environ.setdefault("XLA_FLAGS", f"--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={args.threads}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from examples.llm import flax_llama as FL

    rss0 = _rss()[0]
    t0 = time.perf_counter()
    model = FL.load(folder, jnp.bfloat16)
    jax.block_until_ready(nnx.state(model))
    load_s = time.perf_counter() - t0
    rss, peak, anon = _rss()
    held = sum(a.nbytes for a in jax.tree.leaves(nnx.state(model)))
    out = {"load_s": load_s, "rss_mb": rss, "anon_mb": anon, "peak_mb": peak, "held_bytes": held, "rss_before_mb": rss0}
    vocab = model.cfg["vocab_size"]
    rng = np.random.default_rng(0)
    step = FL.decode_step(model)
    prompt = jnp.asarray(rng.integers(0, vocab, (1, args.prefill)), jnp.int32)
    for _ in range(2):
        logits, _ = step(prompt, model.init_cache(1, args.prefill), jnp.int32(0))
        logits.block_until_ready()
    caches = model.init_cache(1, args.prefill)
    t0 = time.perf_counter()
    step(prompt, caches, jnp.int32(0))[0].block_until_ready()
    out["prefill_tok_s"] = args.prefill / (time.perf_counter() - t0)
    for batch in (1, 8):
        prompt = jnp.asarray(rng.integers(0, vocab, (batch, args.prompt)), jnp.int32)
        max_len = args.prompt + args.decode + 4
        logits, caches = step(prompt, model.init_cache(batch, max_len), jnp.int32(0))
        state = {"tok": jnp.argmax(logits, -1).astype(jnp.int32)[:, None], "caches": caches, "pos": args.prompt}

        def one(state=state):
            lg, state["caches"] = step(state["tok"], state["caches"], jnp.int32(state["pos"]))
            state["tok"] = jnp.argmax(lg, -1).astype(jnp.int32)[:, None]
            state["tok"].block_until_ready()
            state["pos"] += 1

        one()
        out[f"decode_b{batch}_tok_s"] = batch / _median_step(one, args.decode)
    out["rss_end_mb"] = _rss()[0]
    if args.qlora:
        out["qlora_tok_s"] = _jax_qlora(model, vocab, args)
    return out


def _jax_qlora(model, vocab: int, args) -> float:
    """The same QLoRA step in Flax: q4jax.add_lora r=16 on every quantized projection,
    optax AdamW on the adapters only, one --qlora-token sequence, jitted."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import q4jax

    q4jax.add_lora(model, 16, targets=("*_proj",), param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.LoRAParam)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, vocab, (1, args.qlora)), jnp.int32)

    @nnx.jit
    def train_step(model, opt, ids):
        def loss_fn(model):
            logits, _ = model(ids, model.init_cache(1, ids.shape[1]), jnp.int32(0))
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1].astype(jnp.float32), ids[:, 1:]
            ).mean()

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, grads)
        return loss

    train_step(model, opt, ids).block_until_ready()
    return args.qlora / _median_step(lambda: jax.block_until_ready(train_step(model, opt, ids)), 3)


def _llamacpp_run(kind: str, folder: Path, args) -> dict:
    from llm_gguf import gguf_file, load_llama_cpp

    llama_cpp = load_llama_cpp()
    qtype = kind.split("-", 1)[1]
    path = gguf_file(folder, qtype)
    rss0 = _rss()[0]
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        str(path), n_ctx=max(args.prefill, args.prompt + args.decode) + 8, n_threads=args.threads,
        n_threads_batch=args.threads, n_batch=args.prefill, logits_all=False, verbose=False,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    rss, peak, anon = _rss()
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = llm.n_vocab()
    out = {"load_s": load_s, "rss_mb": rss, "anon_mb": anon, "peak_mb": peak, "held_bytes": path.stat().st_size,
           "rss_before_mb": rss0}  # fmt: skip
    prompt = [int(t) for t in rng.integers(0, vocab, args.prefill)]
    llm.reset()
    llm.eval(prompt)  # warm
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    out["prefill_tok_s"] = args.prefill / (time.perf_counter() - t0)
    llm.reset()
    llm.eval([int(t) for t in rng.integers(0, vocab, args.prompt)])

    def step():
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([tok])

    step()
    out["decode_b1_tok_s"] = 1 / _median_step(step, args.decode)
    out["rss_end_mb"] = _rss()[0]
    return out


def child(name: str, folder: Path, args) -> dict:
    if name in ("q4torch", "q4torch+head", "q4torch+head+compile", "q4torch+head+w4a8", "bnb", "bf16", "torchao"):
        return _torch_run(name, folder, args)
    if name in ("q4jax", "q4jax+head"):
        return _jax_run(folder / ("q4-nf4-head" if name.endswith("+head") else "q4-nf4"), args)
    if name.startswith("llamacpp-"):
        return _llamacpp_run(name, folder, args)
    raise ValueError(f"unknown contestant {name!r}; one of {CONTESTANTS}")


# ------------------------------------------------------------------ parent


def prepare(size: str) -> Path:
    """The bf16 float folder of ``size`` (cached) and, beside it, the NF4 folder q4torch
    writes from it (q4-nf4/: the bytes q4jax decodes from)."""
    folder = CACHE / f"llama-{size}"
    if not (folder / "config.json").exists():
        from examples.llm import model as M

        print(f"writing the {size} decoder (random weights) to {folder} ...", flush=True)
        M.make_folder(folder, size)
    for head in (False, True):
        nf4 = folder / ("q4-nf4-head" if head else "q4-nf4")
        if not (nf4 / "config.json").exists():
            import torch
            from transformers import AutoModelForCausalLM

            import q4torch.hf

            print(f"quantizing it with q4torch (Q4Config nf4, quantize_head={head}) into {nf4} ...", flush=True)
            qc = q4torch.hf.Q4Config("nf4", compute_dtype=torch.bfloat16, quantize_head=head)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=qc)
            model.save_pretrained(nf4)
            del model
    return folder


def bytes_per_token(folder: Path) -> dict:
    """Bytes a batch-1 token reads: every weight held except the input embedding table
    (one row a token), the output head included (tied: the embedding's bytes again)."""
    import q4

    cfg = json.loads((folder / "config.json").read_text())
    out = {}
    for sub, what in (("q4-nf4", "q4, bf16 head"), ("q4-nf4-head", "q4+head, NF4 head")):
        tensors = q4.checkpoint.load_checkpoint(folder / sub)
        sub_cfg = json.loads((folder / sub / "config.json").read_text())
        emb = "model.embed_tokens.weight"
        n = sum(v.nbytes for k, v in tensors.items() if k != emb)
        out[what] = n + (
            tensors[emb].nbytes if sub_cfg.get("tie_word_embeddings", cfg.get("tie_word_embeddings")) else 0
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1b", choices=("tiny", "1b", "7b"))
    ap.add_argument("--contestants", default=",".join(CONTESTANTS))
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens before decoding (default 128)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill figure (default 512)")
    ap.add_argument("--decode", type=int, default=24, help="decode steps timed (default 24)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--qlora", type=int, default=512, help="tokens of the QLoRA step's sequence (0: no QLoRA step)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.size == "tiny":
        args.prefill, args.prompt, args.decode = min(args.prefill, 64), min(args.prompt, 16), min(args.decode, 8)
        args.qlora = min(args.qlora, 32)
    if args.child:
        folder = prepare(args.size)
        print("RESULT " + json.dumps(child(args.child, folder, args)), flush=True)
        return 0

    from common import print_header, print_table, write_json

    head = print_header(f"LLM end to end: Llama 3 {args.size} shape, random weights")
    folder = prepare(args.size)
    floor_bytes = bytes_per_token(folder)
    bw = head["roofline"]["dram_read_gbs"] * 1e9
    results = {}
    for name in args.contestants.split(","):
        cmd = [sys.executable, __file__, "--child", name, "--size", args.size, "--prompt", str(args.prompt),
               "--prefill", str(args.prefill), "--decode", str(args.decode), "--threads", str(args.threads),
               "--qlora", str(args.qlora)]  # fmt: skip
        print(f"-- {name} ...", flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode != 0 or not line:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            print(f"   {name}: not run ({' / '.join(tail)})")
            results[name] = {"error": "\n".join(tail)}
            continue
        results[name] = json.loads(line[0][len("RESULT ") :])
    rows = []
    floors = list(floor_bytes.values())
    for name, r in results.items():
        if "error" in r:
            continue
        b1 = r.get("decode_b1_tok_s")
        if name.startswith("llamacpp"):
            floor_ms = r["held_bytes"] / bw * 1e3
        else:
            floor_ms = floors[1 if "+head" in name else 0] / bw * 1e3
        added = r["rss_mb"] - r["rss_before_mb"]
        rows.append([
            name, r["load_s"], r["rss_mb"], r["anon_mb"], r["peak_mb"], r["held_bytes"] / 1e6,
            added / (r["held_bytes"] / 1e6), r["rss_end_mb"], r["prefill_tok_s"], b1,
            1e3 / b1 if b1 else None,
            r.get("matmul_ms_b1"), 1e3 / b1 - r["matmul_ms_b1"] if b1 and r.get("matmul_ms_b1") else None,
            r.get("decode_b8_tok_s"), floor_ms / (1e3 / b1) if b1 else None, r.get("qlora_tok_s"),
        ])  # fmt: skip
    print_table(
        f"Llama 3 {args.size}, {args.threads} threads; prefill {args.prefill} tokens, decode after {args.prompt}",
        ["contestant", "load s", "RSS MB", "anon MB", "peak MB", "weights MB", "load adds / weights", "RSS end MB",
         "prefill tok/s", "decode b1 tok/s",
         "ms/token", "in matmuls ms", "outside ms",
         "decode b8 tok/s", "share of floor", "QLoRA tok/s"],
        rows,
    )  # fmt: skip
    for what, n in floor_bytes.items():
        print(f"decode floor, {what}: {n / 1e6:.0f} MB a token / {bw / 1e9:.1f} GB/s = {n / bw * 1e3:.1f} ms")
    for peer, label, keys in (
        ("llamacpp-q4_0", "llama.cpp Q4_0", ("decode_b1_tok_s", "prefill_tok_s")),
        ("bnb", "bitsandbytes", ("decode_b1_tok_s", "decode_b8_tok_s", "prefill_tok_s")),
    ):
        base = results.get(peer, {})  # (a peer that did not run has no figures: no ratios)
        for name, r in results.items():
            if name == "bnb" or name.startswith("llamacpp") or "error" in r or not base.get("decode_b1_tok_s"):
                continue  # (every other contestant against each peer)
            ratios = [f"{key.replace('_tok_s', '').replace('_', ' ')} {r[key] / base[key]:.2f}x"
                      for key in keys if r.get(key) and base.get(key)]  # fmt: skip
            print(f"{name} / {label}: {', '.join(ratios)}")
    path = write_json(f"llm-{args.size}", {**head, "args": vars(args), "floor_bytes": floor_bytes, "results": results})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
