"""Run PyTorch's own tests for the sorting ops twice, plain and with Kwker installed; compare.

The issue's acceptance test: ``test/test_sort_and_select.py`` and the median / nanmedian / mode /
quantile / kthvalue tests of ``test/test_reductions.py``, from the release matching the installed
torch, must give the same outcome per test with ``kwker.torch_ops.install()`` active as without.

PyTorch's files are third-party code: they are fetched into a cache directory outside this
repository (from ``--pytorch-src`` or GitHub at tag ``v<torch version>``) and never committed.
The file name has no ``test_`` prefix, so the project's own pytest run does not collect it.

    python tests/upstream/run_upstream.py                       # cache, else download
    python tests/upstream/run_upstream.py --pytorch-src ~/pytorch
    python tests/upstream/run_upstream.py --stress-min-numel 1  # also push tiny inputs to Kwker

Exit status: 0 when every outcome matches, 1 when any differs, 2 when the run could not be made.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FILES = ("test/test_sort_and_select.py", "test/test_reductions.py")
RAW_URL = "https://raw.githubusercontent.com/pytorch/pytorch/{ref}/{path}"
# All of test_sort_and_select.py (its class name), plus the named tests of test_reductions.py.
# test_tensor_compare_ops_empty has no op in its name but reduces with torch.median.
SELECT = ("TestSortAndSelect or median or mode or quantile or kthvalue"
          " or test_tensor_compare_ops_empty")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def torch_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().split("+")[0]


def default_cache() -> Path:
    return Path(os.environ.get("KWKER_UPSTREAM_DIR",
                               Path(tempfile.gettempdir()) / "pytorch_tests"))


def obtain(cache: Path, src: Path | None, ref: str, offline: bool) -> dict:
    """Put the upstream files into ``cache`` (unless already there); returns their origin."""
    cache.mkdir(parents=True, exist_ok=True)
    origin_file = cache / "SOURCE.json"
    have = all((cache / Path(p).name).is_file() for p in FILES)
    if src is None and have:
        return json.loads(origin_file.read_text()) if origin_file.is_file() else {
            "origin": "unknown (files found in cache without SOURCE.json)"}
    if src is not None:
        for p in FILES:
            if not (src / p).is_file():
                raise SystemExit(f"--pytorch-src {src}: no {p} there (want a PyTorch checkout)")
            shutil.copyfile(src / p, cache / Path(p).name)
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"],
                                capture_output=True, text=True, check=False).stdout.strip()
        origin = {"origin": f"local checkout {src}", "commit": commit or "unknown",
                  "paths": list(FILES)}
    else:
        if offline:
            raise SystemExit(f"{cache} lacks the upstream files and --offline forbids download; "
                             "pass --pytorch-src PATH")
        for p in FILES:
            url = RAW_URL.format(ref=ref, path=p)
            try:
                with urllib.request.urlopen(url, timeout=60) as r:
                    data = r.read()
            except OSError as e:
                raise SystemExit(f"cannot download {url} ({e}); pass --pytorch-src PATH "
                                 f"or put the files in {cache}") from None
            (cache / Path(p).name).write_bytes(data)
        origin = {"origin": "GitHub pytorch/pytorch", "ref": ref, "paths": list(FILES)}
    origin_file.write_text(json.dumps(origin, indent=1))
    return origin


def run_mode(mode: str, cache: Path, args, min_numel: int | None = None) -> dict:
    """One pytest process over the selected upstream tests; returns the plugin's report."""
    label = mode if min_numel is None else f"{mode}-min{min_numel}"
    report = cache / f"report_{label}.json"
    log = cache / f"run_{label}.log"
    report.unlink(missing_ok=True)
    env = dict(os.environ,
               KWKER_UPSTREAM_MODE=mode, KWKER_UPSTREAM_REPORT=str(report),
               KWKER_UPSTREAM_NUMPY_COMPAT="0" if args.no_numpy_compat else "1",
               PYTORCH_TESTING_DEVICE_ONLY_FOR="cpu",
               PYTORCH_TEST_WITH_SLOW="1" if args.with_slow else "0",
               PYTORCH_PRINT_REPRO_ON_FAILURE="0", CUDA_VISIBLE_DEVICES="")
    env.pop("KWKER_UPSTREAM_MIN_NUMEL", None)
    env["KWKER_UPSTREAM_SHADOW"] = "1" if args.shadow and mode == "kwker" else "0"
    if min_numel is not None:
        env["KWKER_UPSTREAM_MIN_NUMEL"] = str(min_numel)
    paths = [str(HERE)] + ([str(args.kwker_path)] if args.kwker_path else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
           "kwker_upstream_plugin", "-q", "-o", "addopts=", "--rootdir", str(cache),
           "-k", SELECT, *[Path(p).name for p in FILES]]
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=cache, env=env, stdout=f, stderr=subprocess.STDOUT,
                              check=False)
    print(f"[{label}] pytest exit {proc.returncode} in {time.time() - t0:.0f}s, log {log}")
    if proc.returncode not in (0, 1) or not report.is_file():
        tail = log.read_text().splitlines()[-30:]
        raise SystemExit(f"[{label}] pytest did not complete:\n" + "\n".join(tail))
    data = json.loads(report.read_text())
    data["label"], data["command"] = label, cmd
    return data


def compare(base: dict, other: dict) -> list[tuple[str, str, str]]:
    """(test id, base outcome, other outcome) for every test whose outcome differs."""
    a, b = base["outcomes"], other["outcomes"]
    return [(t, a.get(t, "absent"), b.get(t, "absent"))
            for t in sorted(set(a) | set(b)) if a.get(t) != b.get(t)]


def summary(reports: list[dict]) -> str:
    counts = [Counter(r["outcomes"].values()) for r in reports]
    rows = [f"| outcome | {' | '.join(r['label'] for r in reports)} |",
            "|---" * (len(reports) + 1) + "|"]
    for o in OUTCOMES:
        if any(c[o] for c in counts):
            rows.append(f"| {o} | {' | '.join(str(c[o]) for c in counts)} |")
    rows.append(f"| total | {' | '.join(str(sum(c.values())) for c in counts)} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pytorch-src", type=Path, help="PyTorch checkout to copy the tests from")
    ap.add_argument("--cache-dir", type=Path, default=default_cache(),
                    help="where the upstream files and run logs live (outside the repo)")
    ap.add_argument("--ref", help="git ref to download (default: v<installed torch version>)")
    ap.add_argument("--offline", action="store_true", help="never download")
    ap.add_argument("--kwker-path", type=Path,
                    help="import kwker from this checkout instead of the installed one")
    ap.add_argument("--no-numpy-compat", action="store_true",
                    help="do not re-add np.msort / np.quantile(interpolation=) (NumPy 2)")
    ap.add_argument("--with-slow", action="store_true",
                    help="also run the tests PyTorch marks @slowTest (PYTORCH_TEST_WITH_SLOW=1)")
    ap.add_argument("--stress-min-numel", type=int, metavar="N",
                    help="extra Kwker run with its size cut-off lowered to N elements")
    ap.add_argument("--shadow", action="store_true",
                    help="in Kwker runs, re-run each replaced op on ATen and compare bit for bit")
    ap.add_argument("--json", type=Path, help="write the comparison here")
    args = ap.parse_args(argv)

    cache = args.cache_dir.resolve()
    if cache == REPO or REPO in cache.parents:
        print(f"--cache-dir {cache} is inside the repository; third-party files stay outside")
        return 2
    version = torch_version()
    origin = obtain(cache, args.pytorch_src, args.ref or f"v{version}", args.offline)
    print(f"torch {version}; upstream tests: {json.dumps(origin)}")

    base = run_mode("aten", cache, args)
    others = [run_mode("kwker", cache, args)]
    if args.stress_min_numel is not None:
        others.append(run_mode("kwker", cache, args, args.stress_min_numel))
    reports = [base] + others
    print("\n" + summary(reports) + "\n")

    diffs = {}
    for r in others:
        print(f"{r['label']}: kwker from {r.get('kwker')}; kernel calls by op: "
              f"{r['kernel_calls'] or 'none'}")
        diffs[r["label"]] = compare(base, r)
        for t, x, y in diffs[r["label"]]:
            print(f"  DIFFERENT  {t}: {base['label']}={x} {r['label']}={y}")
        if r.get("shadow_checked") is not None:
            bad = r["shadow_mismatches"]
            print(f"  shadow: {sum(r['shadow_checked'].values())} op calls compared with ATen "
                  f"{r['shadow_checked']}; {len(bad)} not bit-identical")
            for m in bad[:40]:
                print(f"  MISMATCH  {m['op']} {m['why']}\n     args={m['args']} "
                      f"kwargs={m['kwargs']}\n     in {m['test']}")
            diffs[r["label"] + " shadow"] = bad
    both_bad = sorted(t for t, o in base["outcomes"].items()
                      if o in ("failed", "error") and
                      all(r["outcomes"].get(t) == o for r in others))
    if both_bad:
        print(f"\nnot passing in every run ({len(both_bad)}; environmental, same outcome):")
        for t in both_bad:
            print(f"  {t}")
    n_diff = sum(len(d) for d in diffs.values())
    print(f"\n{'IDENTICAL outcomes' if n_diff == 0 else f'{n_diff} outcome(s) DIFFER'} "
          f"({len(base['outcomes'])} tests)")
    if args.json:
        args.json.write_text(json.dumps({"torch": version, "source": origin,
                                         "reports": reports, "differences": diffs,
                                         "failing_in_all_runs": both_bad}, indent=1))
    return 1 if n_diff else 0


if __name__ == "__main__":
    sys.exit(main())
