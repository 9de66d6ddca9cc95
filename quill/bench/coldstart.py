"""`quill bench coldstart`: process start -> ready, and peak RSS, of `quill generate` and `quill serve` (to
/health 200) on each model, beside a bare `import torch` measured in the same run (and llama.cpp's
llama-bench / llama-server with --vs llama.cpp); --share starts two servers on one file and reports what
the second adds."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = ("generate", "serve")
_READY = re.compile(r"ready ([0-9.]+) s after process start")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "coldstart", help="cold start and peak RSS of quill generate / serve per model, vs import torch (and llama.cpp)",
        description="Each command runs --runs times, all interleaved, page cache warm; medians are reported, with "
                    "their ratio to a bare `python -c 'import torch'` from the same run.")
    p.add_argument("--models", action="append", default=None, metavar="A.gguf,B.quill",
                   help="model files or folders, comma-separated and/or repeated (default: the embedded model)")
    p.add_argument("--runs", type=int, default=3, help="runs of each command (default 3)")
    p.add_argument("--commands", default=",".join(COMMANDS), help="which of generate,serve to time (default both)")
    p.add_argument("--vs", choices=["llama.cpp"], default=None,
                   help="also time llama.cpp's llama-bench (one token) and llama-server (to /health 200) on each "
                        ".gguf, from LLAMA_BIN (../shared/tools/llamacpp.sh --env sets it)")
    p.add_argument("--share", action="store_true",
                   help="then start two quill serve processes on each model and report each one's Rss/Pss, the "
                        "model file mapping's private pages and the machine's used memory each adds")
    p.add_argument("--json", default=None, help="write every run to this file")
    p.set_defaults(func=run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quill(*args: str) -> list[str]:
    return [sys.executable, "-m", "quill.cli", *args]


def time_command(cmd: list[str], env: dict | None = None) -> dict:
    """Run to completion: wall seconds, peak RSS (MiB, from wait4) and quill's own 'ready' figure if printed."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    with proc.stderr:
        err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {err.strip()[-500:]}")
    ready = _READY.search(err)
    return {"wall_s": wall, "rss_mib": usage.ru_maxrss / 1024, "ready_s": float(ready.group(1)) if ready else None}


def _wait_healthy(proc: subprocess.Popen, port: int, deadline_s: float = 600.0) -> None:
    import httpx

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode} before /health answered 200")
        time.sleep(0.05)
    raise RuntimeError(f"/health did not answer 200 within {deadline_s:.0f} s")


def _status_mib(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def time_server(cmd_for_port, env: dict | None = None) -> dict:
    """Start a server, poll /health every 50 ms: seconds to the first 200 and peak RSS (VmHWM) then."""
    port = _free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd_for_port(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        _wait_healthy(proc, port)
        return {"wall_s": time.perf_counter() - t0, "rss_mib": _status_mib(proc.pid, "VmHWM"), "ready_s": None}
    finally:
        _stop(proc)


def _jobs(models: list[str], commands: list[str], llama_bin: Path | None, env: dict) -> list[tuple[str, object]]:
    jobs: list[tuple[str, object]] = [("import torch", lambda: time_command([sys.executable, "-c", "import torch"]))]
    for kind in commands:
        for m in models:
            name = Path(m).name
            if kind == "generate":
                jobs.append((f"quill generate -n 4  {name}",
                             lambda m=m: time_command(_quill("generate", "-m", m, "-n", "4", "-t", "0", "Hello"))))
            else:
                jobs.append((f"quill serve -> /health  {name}",
                             lambda m=m: time_server(lambda port: _quill("serve", "-m", m, "--port", str(port)))))
            if llama_bin is not None and m.endswith(".gguf"):
                if kind == "generate":
                    jobs.append((f"llama-bench 1 token  {name}", lambda m=m: time_command(
                        [str(llama_bin / "llama-bench"), "-m", m, "-p", "0", "-n", "1", "-r", "1"], env)))
                else:
                    jobs.append((f"llama-server -> /health  {name}", lambda m=m: time_server(
                        lambda port: [str(llama_bin / "llama-server"), "-m", m, "--port", str(port), "-c", "4096"], env)))
    return jobs


def _mapping_mib(pid: int, path: str) -> dict[str, float]:
    """Rss, Pss and private pages of one file's mappings in a process (/proc/PID/smaps)."""
    totals = {"Rss": 0.0, "Pss": 0.0, "Private_Clean": 0.0, "Private_Dirty": 0.0}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:  # a mapping's first line
                inside = line.rstrip().endswith(path)
            elif inside and head and head[0].rstrip(":") in totals:
                totals[head[0].rstrip(":")] += int(head[1]) / 1024
    return totals


def _used_mib() -> float:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def share(model: str) -> dict:
    """Two servers on one model: what each maps of the file, and what the second adds to used memory."""
    import httpx

    path = str(Path(model).resolve())
    procs, used = [], [_used_mib()]
    try:
        for _ in range(2):
            port = _free_port()
            proc = subprocess.Popen(_quill("serve", "-m", model, "--port", str(port), "--kv-cache-memory", "256MiB"),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(proc)
            _wait_healthy(proc, port)
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=300)
            time.sleep(1.0)
            used.append(_used_mib())
        return {"model": model, "file_mib": os.path.getsize(path) / 2**20 if os.path.isfile(path) else None,
                "added_mib": [used[1] - used[0], used[2] - used[1]],
                "mapping": [_mapping_mib(p.pid, path) for p in procs],
                "rss_mib": [_status_mib(p.pid, "VmRSS") for p in procs]}
    finally:
        for proc in procs:
            _stop(proc)


def run(args: argparse.Namespace) -> int:
    if args.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {args.runs}")
    commands = [c.strip() for c in args.commands.split(",") if c.strip()]
    bad = [c for c in commands if c not in COMMANDS]
    if bad or not commands:
        raise ValueError(f"--commands takes {', '.join(COMMANDS)}; got {args.commands!r}")
    if args.models:
        models = [m.strip() for group in args.models for m in group.split(",") if m.strip()]
    else:
        from quill.models.default import default_model_path

        models = [str(default_model_path())]
    for m in models:
        if not Path(m).exists():
            raise FileNotFoundError(f"model {m!r} does not exist")
    llama_bin, env = None, dict(os.environ)
    if args.vs:
        llama_bin = Path(os.environ.get("LLAMA_BIN", ""))
        if not os.environ.get("LLAMA_BIN") or not (llama_bin / "llama-server").is_file():
            raise ValueError("--vs llama.cpp needs LLAMA_BIN naming a folder with llama-bench and llama-server "
                             "(eval \"$(bash ../shared/tools/llamacpp.sh --env)\")")
        env["LD_LIBRARY_PATH"] = f"{llama_bin}:{env.get('LD_LIBRARY_PATH', '')}"
    jobs = _jobs(models, commands, llama_bin, env)
    results: dict[str, list[dict]] = {name: [] for name, _ in jobs}
    for i in range(args.runs):
        for name, job in jobs:
            print(f"[{i + 1}/{args.runs}] {name}", file=sys.stderr, flush=True)
            results[name].append(job())
    torch_s = statistics.median(r["wall_s"] for r in results["import torch"])
    print(f"{'command':52s} {'wall median':>11s} {'(min-max)':>15s} {'x torch':>8s} {'ready':>8s} {'peak RSS':>10s}")
    for name, runs in results.items():
        wall = [r["wall_s"] for r in runs]
        ready = [r["ready_s"] for r in runs if r["ready_s"] is not None]
        ready_text = f"{statistics.median(ready):6.2f} s" if ready else f"{'':8s}"
        print(f"{name:52s} {statistics.median(wall):9.2f} s ({min(wall):5.2f}-{max(wall):5.2f}) "
              f"{statistics.median(wall) / torch_s:7.2f}x {ready_text} "
              f"{statistics.median(r['rss_mib'] for r in runs):6.0f} MiB")
    print("wall: the whole command (generate: load, 4 tokens, exit; serve: to the first /health 200); ready: quill's "
          "own cold-start line (process start -> engine ready)")
    shared = []
    if args.share:
        for m in models:
            s = share(m)
            shared.append(s)
            file_mib = s["file_mib"] or 0.0
            print(f"two servers on {Path(m).name} ({file_mib:.0f} MiB): used memory +{s['added_mib'][0]:.0f} MiB, "
                  f"then +{s['added_mib'][1]:.0f} MiB for the second")
            for label, rss, mp in zip(("first", "second"), s["rss_mib"], s["mapping"]):
                print(f"  {label}: RSS {rss:.0f} MiB; the file's mapping: " +
                      ", ".join(f"{k} {v:.0f}" for k, v in mp.items()) + " MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "import_torch_s": torch_s, "share": shared}, indent=1))
    return 0
