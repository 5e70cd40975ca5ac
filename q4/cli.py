"""The ``q4`` command: quantize, inspect and check checkpoints.

    q4 quantize model.safetensors model-nf4.safetensors --type nf4
    q4 inspect model-nf4.safetensors
    q4 parity model-nf4.safetensors

User mistakes (missing or corrupted files, bad options) print one line,
``q4: error: ...``, and exit with status 1 (2 for a malformed command line).
SIGINT, SIGTERM and SIGHUP stop the command the same way: temporary files are
removed, nothing half-written is published, and the exit status is 128 + the
signal number (130, 143, 129).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from q4._src.formats import LAYER_TYPES

_EPILOG_QUANTIZE = """\
Every 2-D float32/float16/bfloat16 tensor named '*.weight' becomes a quantized
layer in the bitsandbytes format (loadable by q4torch.nn.Linear4bit /
Linear8bitLt, q4jax.nn.Linear4bit / Linear8bit and bitsandbytes); everything
else is copied unchanged. Layers whose name (the key without '.weight')
matches --skip or one of the default patterns ({skip}) are kept.

IN may be a .safetensors file, a sharded checkpoint's *.index.json, or a
directory holding either. OUT is a .safetensors file, or for sharded input a
directory (or *.index.json path) that receives one shard per input shard and
a new index (from a model directory to a directory, the model's other regular
files such as config and tokenizer are copied too; a link out of the folder or
a special file is refused, or left out with --skip-unsafe-files). Tensors are processed one at a time (a checkpoint larger than
memory works); nothing is written under OUT's name until everything is done.

examples:
  q4 quantize model.safetensors model-nf4.safetensors
  q4 quantize model.safetensors model-int8.safetensors --type int8
  q4 quantize ckpt/model.safetensors.index.json ckpt-fp4/ --type fp4 --blocksize 128 --skip 'lm_head'
"""


class UserError(Exception):
    """A mistake in the command's input: reported as one line, exit status 1."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: raised in the main thread (as KeyboardInterrupt
    is for SIGINT) so that every ``finally`` and ``with`` block cleans up."""


def _terminate(signum, frame):
    signal.signal(signum, signal.SIG_IGN)  # a repeated signal must not interrupt the clean-up
    raise Terminated(signum)


# ----------------------------------------------------------------- output


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def table(header: list[str], rows: list[list[Any]] | list[Any], out=None) -> None:
    """A plain-text table; the first column is left-aligned, the rest right-aligned."""
    out = out or sys.stdout
    cells = [[str(h) for h in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, r in enumerate(cells):
        line = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        print(line.rstrip(), file=out)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=out)


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label: str, unit: str = "bytes", enabled: bool | None = None):
        self.label, self.unit = label, unit
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = 0.0
        self._t0 = time.perf_counter()

    def __call__(self, done: int, total: int, item: str) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        count = f"{_human(done)}/{_human(total)}" if self.unit == "bytes" else f"{done}/{total}"
        line = f"{self.label} {100 * frac:3.0f}% [{bar:<30}] {count} {item}"
        sys.stderr.write("\r" + line[:120].ljust(120))
        if done >= total:
            sys.stderr.write(f"\r{' ' * 120}\r{self.label}: done in {now - self._t0:.1f} s\n")
        sys.stderr.flush()


# --------------------------------------------------------------- commands


# GPTQ's calibration pass runs the model in transformers (PyTorch): found by
# name, as `q4 parity` finds each front end's adapter (q4/ imports no front end)
GPTQ_CALIBRATION = "q4torch._src.replace:calibration_hessians"


def _calibration_hessians(args) -> dict:
    """GPTQ's Hessians by layer name: the model folder loaded with transformers
    (float, CPU), each line of the calibration file one unpadded batch, every
    nn.Linear whose in_features is a multiple of the block hooked
    (q4torch.replace_linear's calibration pass). Imports torch and
    transformers here only."""
    from pathlib import Path

    src = Path(args.input)
    if not (src.is_dir() and (src / "config.json").is_file()):
        raise ValueError(f"--method gptq needs a model folder with config.json (transformers loads it), got {src}")
    lines = [t.strip() for t in Path(args.calibration).read_text(encoding="utf-8").splitlines() if t.strip()]
    if not lines:
        raise ValueError(f"{args.calibration}: no calibration text (one text per line)")
    from q4._src import plugins

    return plugins.load(GPTQ_CALIBRATION)(src, lines, args.blocksize)


def cmd_quantize(args) -> int:
    from q4._src.convert import Options, quantize_checkpoint

    if args.calibration and args.method != "gptq":
        raise ValueError(f"--calibration applies to --method gptq, not to --method {args.method}")

    opts = Options(
        quant_type=args.type,
        blocksize=args.blocksize,
        nested=not args.no_nested,
        skip=tuple(args.skip),
        default_skip=not args.no_default_skip,
        embeddings=args.embeddings,
        method=args.method,
        hessians=_calibration_hessians(args) if args.method == "gptq" and args.calibration else None,
        gptq_damp=args.damp,
        skip_unsafe_files=args.skip_unsafe_files,
    )
    res = quantize_checkpoint(args.input, args.output, opts, progress=Progress("quantize", enabled=args.progress))
    for warning in res.warnings:
        print(f"q4: warning: {warning}", file=sys.stderr)
    if not res.layers:
        print("warning: no layer was quantized (every 2-D '*.weight' was skipped or none exists)", file=sys.stderr)
    fmt = (
        args.type
        if args.type == "int8"
        else f"{args.type}, block {args.blocksize}, {'plain' if args.no_nested else 'nested'} absmax"
    )
    print(f"{args.input} -> {', '.join(str(p) for p in res.outputs)} ({fmt})")
    if args.verbose and res.layers:
        table(
            ["layer", "shape", "dtype", "bytes before", "bytes after", "rel. error"],
            [
                [r.name, "x".join(map(str, r.shape)), r.dtype, r.bytes_before, r.bytes_after, f"{r.rel_error:.4f}"]
                for r in res.layers
            ],
        )
        print()
    q_in = sum(r.bytes_before for r in res.layers)
    q_out = sum(r.bytes_after for r in res.layers)
    kept_bytes = res.bytes_in - q_in
    errs = [r.rel_error for r in res.layers]
    worst = max(res.layers, key=lambda r: r.rel_error, default=None)
    rows = [
        [
            "quantized layers",
            len(res.layers),
            _human(q_in),
            _human(q_out),
            f"{sum(errs) / len(errs):.4f}" if errs else "-",
        ],
        ["other tensors (copied)", len(res.kept), _human(kept_bytes), _human(kept_bytes), "-"],
        ["file(s)", "", _human(res.bytes_in), _human(res.bytes_out), ""],
    ]
    table(["", "count", "bytes before", "bytes after", "mean rel. error"], rows)
    if worst is not None:
        print(f"largest error: {worst.name} ({worst.rel_error:.4f}); rel. error = ||W - Q(W)||_F / ||W||_F")
    if res.copied:
        names = ", ".join(str(p) for p in res.copied[:4]) + (", ..." if len(res.copied) > 4 else "")
        print(f"copied {len(res.copied)} other files of the model directory ({names})")
    if res.skipped:
        print(
            f"kept in full precision by --skip/default patterns: {len(res.skipped)} layers ({', '.join(list(res.skipped)[:4])}{', ...' if len(res.skipped) > 4 else ''})"
        )
    return 0


def _files_of(path) -> list[Path]:
    from q4._src.container import input_files

    return input_files(path)[0]


def cmd_inspect(args) -> int:
    from q4._src.checkpoint import inspect_file

    rows, n_layers, q_bytes, dense_bytes, total, other, files = [], 0, 0, 0, 0, 0, _files_of(args.file)
    every: dict[str, dict] = {}
    for path in files:
        info = inspect_file(path)
        every.update(info["layers"])
        for name, meta in info["layers"].items():
            shape = meta["shape"]
            if meta["kind"] == "Linear4bit":
                kind, block, nested = meta["quant_type"], meta["blocksize"], "yes" if meta["nested"] else "no"
            else:
                kind, block, nested = "int8", "row", "-"
            rows.append([name, "x".join(map(str, shape)), kind, block, nested, meta["bytes"]])
            n_layers += 1
            q_bytes += meta["bytes"]
            dense_bytes += 4 * math.prod(shape)
        other += info["other_bytes"]
        total += info["file_bytes"]
    if Path(args.file).is_dir():  # (a model folder; a file beside a float model's config is not checked)
        _check_folder_config(Path(args.file) / "config.json", every)
    if rows:
        table(["layer", "shape", "type", "block", "nested", "bytes"], rows)
        print()
    else:
        print("no quantized layers in this checkpoint")
    summary = [
        ["quantized layers", n_layers, _human(q_bytes)],
        ["  same weights in fp32", "", _human(dense_bytes)],
        ["other tensors", "", _human(other)],
        [f"file{'s' if len(files) > 1 else ''} ({len(files)})", "", _human(total)],
    ]
    table(["totals", "count", "bytes"], summary)
    if q_bytes and dense_bytes:  # (validation refuses empty layers; never divide by zero)
        print(
            f"quantized layers take {q_bytes / dense_bytes:.1%} of their fp32 size ({dense_bytes / q_bytes:.2f}x smaller)"
        )
    return 0


def _check_folder_config(path: Path, layers: dict[str, dict]) -> None:
    """A model folder's config.json must describe its quantized layers (schema.check_model_config)."""
    import json

    from q4._src.schema import check_model_config

    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read the model's config ({e})") from e
    check_model_config(config, layers, path)


def cmd_parity(args) -> int:
    from q4.parity import check_file

    files = _files_of(args.file)
    checks = []
    for path in files:
        checks += check_file(
            path,
            batch=args.batch,
            seed=args.seed,
            layers=args.layer or None,
            progress=Progress("parity", "layers", args.progress),
        )
    if args.layer:
        missing = sorted(set(args.layer) - {c.name for c in checks})
        if missing:
            raise UserError(f"no quantized layer named {', '.join(map(repr, missing))} in {args.file}")
    if not checks:
        raise UserError(f"{args.file} has no quantized layers to check")
    rows = []
    for c in checks:
        fmt = (
            "int8"
            if c.spec.kind == "8bit"
            else f"{c.spec.quant_type}/{c.spec.blocksize}{'/nested' if c.spec.nested else ''}"
        )
        rows.append(
            [
                c.name,
                fmt,
                "yes" if c.bytes_identical else "NO",
                f"{c.err['q4torch']:.2e}",
                f"{c.err['q4jax']:.2e}",
                f"{max(c.ratio.values()):.3f}",
                f"{c.cross:.2e}",
                "ok" if c.ok else "FAIL",
            ]
        )
    table(["layer", "format", "bytes identical", "torch err", "jax err", "err/bound", "torch-jax", "result"], rows)
    bad = [c for c in checks if not c.ok]
    print(
        f"\n{len(checks) - len(bad)}/{len(checks)} layers pass. err: max |output or input gradient - fp64 reference| "
        f"on random inputs (batch {args.batch}, seed {args.seed}); bound: the fp32 rounding bound "
        "(+ int8 activation rounding for 8-bit layers)."
    )
    return 1 if bad else 0


# ------------------------------------------------------------------ parser


def q4_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("q4")
    except metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH
        import q4

        return q4.__version__


def build_parser() -> argparse.ArgumentParser:
    from q4._src.convert import DEFAULT_SKIP

    p = argparse.ArgumentParser(
        prog="q4",
        description="4-bit (NF4/FP4) and 8-bit weight quantization for PyTorch and JAX, one checkpoint format.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'q4 COMMAND --help' for a command's options.",
    )
    p.add_argument("--version", action="version", version=f"q4 {q4_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    progress = argparse.ArgumentParser(add_help=False)
    progress.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw a progress bar on stderr (default: when stderr is a terminal)",
    )

    q = sub.add_parser(
        "quantize",
        parents=[progress],
        help="quantize a safetensors checkpoint's linear weights",
        description="Quantize the linear weights of a safetensors checkpoint into q4's (bitsandbytes') format.",
        epilog=_EPILOG_QUANTIZE.format(skip=", ".join(DEFAULT_SKIP)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    q.add_argument("input", metavar="IN", help="float checkpoint: .safetensors file, *.index.json, or directory")
    q.add_argument("output", metavar="OUT", help="quantized checkpoint: .safetensors file (or directory for shards)")
    q.add_argument("--type", choices=list(LAYER_TYPES), default="nf4", help="format (default: nf4)")
    q.add_argument(
        "--blocksize",
        type=int,
        default=None,
        metavar="N",
        help="4-bit block size, a power of two in [32, 4096] (default: 64; int8 scales each row, so refuses it)",
    )
    q.add_argument("--no-nested", action="store_true", help="4-bit: keep the fp32 absmax (no nested 8-bit statistics)")
    q.add_argument(
        "--method",
        default="absmax",
        metavar="M",
        help="4-bit scales and codes: absmax (bitsandbytes', default), mse (per-block scale search) or gptq "
        "(with --calibration; a model folder transformers loads); the same format",
    )
    q.add_argument(
        "--calibration",
        metavar="FILE",
        help="gptq: calibration texts, one per line (tokenized with the folder's tokenizer)",
    )
    q.add_argument(
        "--damp",
        type=float,
        default=0.01,
        metavar="F",
        help="gptq: damping added to each Hessian's diagonal, a fraction of its mean (default 0.01)",
    )
    q.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keep layers matching this fnmatch pattern unquantized (repeat for more)",
    )
    q.add_argument(
        "--no-default-skip", action="store_true", help="do not skip the default patterns (embeddings, lm_head)"
    )
    q.add_argument(
        "--embeddings",
        action="store_true",
        help="quantize the embeddings too (the default embedding patterns; lm_head stays kept): they load as "
        "q4torch.nn / q4jax.nn Embedding4bit or Embedding8bit through load_quantized; bitsandbytes has no "
        "quantized embeddings, so a model folder's config.json then names model_type q4_quantized_embeddings "
        "(transformers refuses it instead of misreading the table)",
    )
    q.add_argument(
        "--skip-unsafe-files",
        action="store_true",
        help="model folder: leave out, with a warning, files that are symbolic links leading out of the folder or "
        "not regular files (FIFOs, devices, sockets); without it they are refused (only regular files are copied)",
    )
    q.add_argument("-v", "--verbose", action="store_true", help="print one row per quantized layer")
    q.set_defaults(func=cmd_quantize)

    i = sub.add_parser(
        "inspect",
        help="list the quantized layers of a checkpoint",
        description="List the quantized layers of a checkpoint (validating every one) and the file's totals.",
    )
    i.add_argument("file", metavar="FILE", help=".safetensors file, *.index.json, or directory")
    i.set_defaults(func=cmd_inspect)

    c = sub.add_parser(
        "parity",
        parents=[progress],
        help="check that PyTorch and JAX load and run a checkpoint identically",
        description=(
            "Load every quantized layer in q4torch and in q4jax, check that both hold the file's exact bytes, and "
            "compare their outputs and input gradients on random inputs with an fp64 reference computed from the "
            "stored weights. Exits with status 1 if any layer fails."
        ),
    )
    c.add_argument("file", metavar="FILE", help=".safetensors file, *.index.json, or directory")
    c.add_argument("--batch", type=int, default=4, metavar="N", help="rows of random input per layer (default: 4)")
    c.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    c.add_argument("--layer", action="append", metavar="NAME", help="check only this layer (repeat for more)")
    c.set_defaults(func=cmd_parity)

    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "batch", 1) < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    if getattr(args, "func", None) is cmd_quantize:
        if args.type == "int8":
            # int8 has one scale per row: a block size or nested statistics would be ignored in silence
            if args.blocksize is not None:
                parser.error(
                    f"--blocksize {args.blocksize} applies to the 4-bit types (nf4, fp4); int8 scales each row"
                )
            if args.no_nested:
                parser.error("--no-nested applies to the 4-bit types (nf4, fp4); int8 has no nested statistics")
        args.blocksize = 64 if args.blocksize is None else args.blocksize
    from q4._src.checkpoint import CheckpointError
    from q4._src.native import NativeLibraryError
    from q4._src.quant_state import QuantStateError

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:  # (leave an ignored SIGHUP, as under nohup, ignored)
                previous[sig] = signal.signal(sig, _terminate)
    try:
        return args.func(args)
    except BrokenPipeError:
        # the reader went away (`q4 inspect ... | head`): stop quietly, as a pipeline's writer does;
        # stdout goes to /dev/null so the interpreter's final flush does not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    except (UserError, CheckpointError, QuantStateError, NativeLibraryError, ValueError, OSError) as e:
        msg = str(e) or type(e).__name__
        print(f"q4: error: {msg.splitlines()[0] if msg else msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("q4: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"q4: terminated ({signal.Signals(e.args[0]).name})", file=sys.stderr)
        return 128 + e.args[0]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
