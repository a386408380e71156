"""PyTorch's own distributed test suite on braid, compared with gloo run
through the same plugin hook.

upstream_dist.py runs torch's DistributedTest._DistTestBase (the suite behind
test/distributed/test_distributed_spawn.py) on the "braid" backend, which the
suite knows only as a plugin: tests written for gloo or nccl by name skip
themselves or take other paths. To tell braid's failures from what a plugin
backend cannot pass anyway, this runner registers gloo under a plugin name,
"glooplugin" (a ProcessGroupGloo made on the given store, rank, size and
timeout, as torch makes its own), and gives it exactly the DistTestCases
feature flags and skip entries that upstream_dist.py gives braid: it imports
upstream_dist.py and copies braid's membership of every DistTestCases set,
and its test class derives from upstream_dist.py's. So the two runs differ
only in the backend implementation.

    python upstream_compare.py list [-k PAT]... [--chunk I/N]
    python upstream_compare.py run --backend braid|glooplugin --results FILE
                                   [-k PAT]... [--chunk I/N] [NAME|@FILE]...
                                   [--timeout S] [--again]
    python upstream_compare.py compare GLOO_FILE BRAID_FILE
                                   [--gloo-rerun FILE] [--braid-rerun FILE]
                                   [--names-out FILE]

`run` runs the selected tests one at a time (each spawns WORLD_SIZE=2 ranks),
and appends one tab-separated line per test to FILE as soon as it ends:

    name  outcome  seconds  first line of the failure / skip reason

outcome is passed, failed, skipped or timeout. A run resumes: tests that
already have a line in FILE are left out (--again runs them anyway and
appends; the last line of a test counts). A selection splits the suite:
-k PAT (a substring, or a glob if it has * ? [, as unittest's -k; several
are or-ed), --chunk I/N (the I-th of N contiguous slices of the sorted
selection), or names (NAME, or @FILE with names). The per-test timeout
(--timeout, default 180 s) is the suite's own (DISTRIBUTED_TESTS_DEFAULT_TIMEOUT;
it kills the ranks; the suite keeps its longer limits for
test_DistributedDataParallel and test_ddp_uneven_inputs); a watchdog kills
the whole worker, records the test as a timeout and goes on if a test
outlives that by --grace seconds. Full error texts go to FILE.d/<name>.txt,
the ranks' output to FILE.log (between "=== START <name>" markers).

`compare` prints the tests that pass on glooplugin but not on braid, with
braid's failure line, and a summary of both files; rerun files (a `run`
of those names into another FILE) add each test's later outcomes, to tell
consistent failures from flaky ones.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGIN_GLOO = "glooplugin"
BACKENDS = ("braid", PLUGIN_GLOO)
WORKER_ENV = "BRAID_UPSTREAM_COMPARE_WORKER"
OUTCOMES = ("passed", "failed", "skipped", "timeout")


# --------------------------------------------------------------------------
# The test module: set up in the worker and, as __mp_main__, in every rank it
# spawns (both have WORKER_ENV set), never in the driver.
# --------------------------------------------------------------------------


def _create_gloo_plugin(opts, backend_options):
    """Creator for the plugin "glooplugin": gloo as torch makes it
    (distributed_c10d._create_gloo_process_group), on the plugin path."""
    from torch.distributed import ProcessGroupGloo

    pg = ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, timeout=opts.timeout)
    pg.options.global_ranks_in_group = opts.global_ranks_in_group
    pg.options.group_name = opts.group_id
    return pg


DIST_TEST_MODULE = "torch.testing._internal.distributed.distributed_test"


def _copy_braid_flags() -> list[str]:
    """Put glooplugin in exactly the DistTestCases sets braid is in."""
    from torch.testing._internal.common_distributed import DistTestCases

    copied = []
    for table_name, table in vars(DistTestCases).items():
        if not isinstance(table, dict):
            continue
        for key, members in table.items():
            if isinstance(members, set):
                members.discard(PLUGIN_GLOO)
                if "braid" in members:
                    members.add(PLUGIN_GLOO)
                    copied.append(f"{table_name}[{key!r}]")
    return copied


class _BeforeDistTest:
    """Meta path hook: copies braid's flags just before distributed_test.py
    runs. Its decorators read DistTestCases when the module is executed
    (upstream_dist.py sets braid's flags before importing it), so glooplugin
    must be in the same sets at that moment, not only afterwards."""

    copied: list[str] | None = None

    def find_spec(self, name, path, target=None):
        if name != DIST_TEST_MODULE:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            _BeforeDistTest.copied = _copy_braid_flags()
            run_module(module)

        spec.loader.exec_module = exec_module
        return spec


def _setup_test_module():
    g = globals()
    if os.environ.get("BACKEND") not in BACKENDS:
        raise SystemExit(f"BACKEND must be one of {BACKENDS}")
    if DIST_TEST_MODULE in sys.modules:
        raise SystemExit(f"{DIST_TEST_MODULE} imported before the flags were copied")
    sys.path.insert(0, str(HERE))
    import torch.distributed as dist

    if PLUGIN_GLOO.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(PLUGIN_GLOO, _create_gloo_plugin, extended_api=True, devices=["cpu"])

    sys.meta_path.insert(0, _BeforeDistTest())
    import upstream_dist  # noqa: E402  braid's flags; registers braid

    from torch.testing._internal.distributed.distributed_test import DistributedTest

    if _BeforeDistTest.copied is None:
        raise SystemExit("the flags were not copied before distributed_test.py ran")
    after = _copy_braid_flags()  # and whatever upstream_dist.py set afterwards
    g["COPIED_FLAGS"] = (_BeforeDistTest.copied, after)

    base = [
        v
        for v in vars(upstream_dist).values()
        if isinstance(v, type) and issubclass(v, DistributedTest._DistTestBase)
    ]
    if len(base) != 1:
        raise SystemExit(f"upstream_dist.py: expected one test class, found {base}")

    class TestUpstream(base[0]):
        pass

    TestUpstream.__module__ = __name__
    TestUpstream.__qualname__ = "TestUpstream"
    g["TestUpstream"] = TestUpstream


if os.environ.get(WORKER_ENV) == "1":
    _setup_test_module()


# --------------------------------------------------------------------------
# Results files
# --------------------------------------------------------------------------


def _clean(s: str, limit: int = 400) -> str:
    s = " ".join(s.replace("\t", " ").split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def read_results(path) -> dict[str, list[tuple[str, float, str]]]:
    """name -> [(outcome, seconds, message), ...] in file order."""
    res: dict[str, list[tuple[str, float, str]]] = {}
    p = Path(path)
    if not p.exists():
        return res
    for line in p.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) < 3 or parts[1] not in OUTCOMES:
            continue
        msg = parts[3] if len(parts) > 3 else ""
        res.setdefault(parts[0], []).append((parts[1], float(parts[2]), msg))
    return res


def append_result(path, name, outcome, seconds, message):
    with open(path, "a") as f:
        f.write(f"{name}\t{outcome}\t{seconds:.1f}\t{_clean(message)}\n")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------
# Worker: runs given tests in one process (spawning ranks per test)
# --------------------------------------------------------------------------

_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure|Timeout|Warning)\b.*|[A-Za-z_][\w.]*: .*)$")


def _exception_line(tb: str) -> str:
    """The "SomeError: message" line of the last exception of a traceback."""
    lines = tb.splitlines()
    last_frame = max((i for i, l in enumerate(lines) if l.startswith("  File ")), default=-1)
    for l in lines[last_frame + 1 :]:
        if l and not l.startswith(" ") and _EXC_LINE.match(l):
            return l
    for l in reversed(lines):
        if _EXC_LINE.match(l):
            return l
    return next((l for l in lines if l.strip()), "")


def first_failure_line(err: str) -> str:
    """From unittest's error text: the ranks' exception if a rank raised one
    (the suite passes them up as "Process i exited with error code 10 and
    exception:\\n<traceback>"), else the test process's own."""
    m = re.search(r"Process (\d+) exited with error code \d+ and exception:\n", err)
    if m:
        rest = err[m.end() :]
        nxt = re.search(r"\nProcess \d+ exited with error code \d+ and exception:\n", rest)
        tb = rest[: nxt.start()] if nxt else rest
        return f"rank {m.group(1)}: {_exception_line(tb)}"
    return _exception_line(err)


def _worker_main(args):
    import unittest

    from torch.testing._internal import common_distributed, common_utils

    argv0 = sys.argv[0]
    sys.argv = [argv0]
    common_utils.parse_cmd_line_args()  # as run_tests() does

    names = [n for n in Path(args.names_file).read_text().split() if n]
    results = args.results
    details = Path(results + ".d")
    details.mkdir(exist_ok=True)
    state = Path(args.state_file)
    cls = TestUpstream  # noqa: F821  (defined by _setup_test_module)
    print(f"# worker BACKEND={os.environ['BACKEND']} flags copied from braid (before distributed_test ran, after): {COPIED_FLAGS}", flush=True)  # noqa: F821

    class Recorder(unittest.TestResult):
        def startTest(self, test):
            super().startTest(test)
            name = test.id().split(".")[-1]
            self._t0 = time.time()
            self._outcome = ("passed", "")
            self._timeout = common_distributed.get_timeout(test.id())
            state.write_text(f"{name}\t{self._t0}\t{self._timeout}\n")
            print(f"\n=== START {name}", flush=True)
            print(f"\n=== START {name}", file=sys.stderr, flush=True)

        def _fail(self, test, err):
            text = self._exc_info_to_string(err, test)
            line = first_failure_line(text)
            elapsed = time.time() - self._t0
            timed_out = re.search(r"terminated or timed out after", text) and elapsed >= self._timeout - 1
            self._outcome = ("timeout" if timed_out else "failed", line)
            name = test.id().split(".")[-1]
            (details / f"{name}.txt").write_text(text)

        addError = _fail
        addFailure = _fail

        def addSubTest(self, test, subtest, err):
            if err is not None:
                self._fail(test, err)

        def addSkip(self, test, reason):
            self._outcome = ("skipped", reason)

        def addExpectedFailure(self, test, err):
            self._outcome = ("passed", "expected failure")

        def addUnexpectedSuccess(self, test):
            self._outcome = ("failed", "unexpected success")

        def stopTest(self, test):
            super().stopTest(test)
            name = test.id().split(".")[-1]
            outcome, msg = self._outcome
            append_result(results, name, outcome, time.time() - self._t0, msg)
            print(f"=== END {name} {outcome}", flush=True)
            print(f"=== END {name} {outcome}", file=sys.stderr, flush=True)
            state.write_text("")

    for n in [n for n in names if not hasattr(cls, n)]:
        append_result(results, n, "failed", 0.0, "no such test in the suite")
    suite = unittest.TestSuite(cls(n) for n in names if hasattr(cls, n))
    suite.run(Recorder())
    return 0


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def _matches(name: str, patterns: list[str]) -> bool:
    for p in patterns:
        if any(c in p for c in "*?["):
            if fnmatch.fnmatchcase(name, p):
                return True
        elif p in name:
            return True
    return False


def all_test_names() -> list[str]:
    """The suite's test names (from the source, so the driver imports no torch)."""
    env = dict(os.environ, BACKEND="gloo", WORLD_SIZE="2", TEMP_DIR=tempfile.gettempdir())
    code = (
        "import unittest\n"
        "from torch.testing._internal.distributed.distributed_test import DistributedTest\n"
        "print('\\n'.join(unittest.TestLoader().getTestCaseNames(DistributedTest._DistTestBase)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    return sorted(n for n in out.stdout.split() if n.startswith("test"))


def select(args) -> list[str]:
    names = []
    for a in args.names:
        names += Path(a[1:]).read_text().split() if a.startswith("@") else [a]
    if not names:
        names = all_test_names()
    if args.k:
        names = [n for n in names if _matches(n, args.k)]
    if args.chunk:
        i, n = (int(x) for x in args.chunk.split("/"))
        if not 1 <= i <= n:
            raise SystemExit("--chunk I/N needs 1 <= I <= N")
        size = -(-len(names) // n)
        names = names[(i - 1) * size : i * size]
    return names


def _kill_group(proc: subprocess.Popen):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        # the group may outlive its leader (ranks): kill what is left
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(args) -> int:
    if args.backend not in BACKENDS:
        raise SystemExit(f"--backend must be one of {BACKENDS}")
    names = select(args)
    results = os.path.abspath(args.results)
    Path(results).parent.mkdir(parents=True, exist_ok=True)
    done = read_results(results)
    todo = names if args.again else [n for n in names if n not in done]
    print(f"{args.backend}: {len(names)} selected, {len(names) - len(todo)} already in {results}, {len(todo)} to run", flush=True)
    if not todo:
        return 0
    with open(results, "a") as f:
        f.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} run BACKEND={args.backend} timeout={args.timeout} tests={len(todo)}\n")

    work = Path(tempfile.mkdtemp(prefix=f"upstream-{args.backend}-"))
    names_file = work / "names"
    state_file = work / "state"
    log = open(results + ".log", "a")
    start_failures = 0
    try:
        while todo:
            temp_dir = work / "temp"
            shutil.rmtree(temp_dir, ignore_errors=True)
            temp_dir.mkdir()
            names_file.write_text("\n".join(todo) + "\n")
            state_file.write_text("")
            env = dict(
                os.environ,
                BACKEND=args.backend,
                WORLD_SIZE="2",
                TEMP_DIR=str(temp_dir),
                OMP_NUM_THREADS="1",
                DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.timeout),
                PYTHONUNBUFFERED="1",
            )
            env[WORKER_ENV] = "1"
            env.pop("CI", None)  # run_tests-style XML output needs xmlrunner
            before = {n: len(v) for n, v in read_results(results).items()}
            cmd = [sys.executable, str(Path(__file__).resolve()), "_worker", "--results", results,
                   "--names-file", str(names_file), "--state-file", str(state_file)]
            proc = subprocess.Popen(cmd, cwd=str(HERE), env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            hung = None
            seen = dict(before)

            def report():
                now = read_results(results)
                for n in todo:
                    if len(now.get(n, [])) > seen.get(n, 0):
                        seen[n] = len(now[n])
                        o, s, m = now[n][-1]
                        print(f"[{len(done_names(now, names))}/{len(names)}] {o:<8} {s:7.1f}s {n}  {m[:150]}", flush=True)

            while proc.poll() is None:
                time.sleep(2)
                report()
                st = state_file.read_text().split("\t") if state_file.exists() else []
                if len(st) == 3:
                    name, t0, tmo = st[0], float(st[1]), float(st[2])
                    if time.time() - t0 > tmo + args.grace:
                        hung = (name, time.time() - t0)
                        _kill_group(proc)
                        break
            # Leftover ranks of the last test (if any) die with the group.
            _kill_group(proc)
            report()
            after = read_results(results)
            new = [n for n in todo if len(after.get(n, [])) > before.get(n, 0)]
            if hung:
                append_result(results, hung[0], "timeout", hung[1], f"watchdog: killed the worker after {hung[1]:.0f} s")
                print(f"          timeout  {hung[1]:7.1f}s {hung[0]}  (watchdog)", flush=True)
                new.append(hung[0])
            elif proc.returncode != 0 or len(new) < len(todo):
                st = state_file.read_text().split("\t") if state_file.exists() else []
                if len(st) == 3:
                    # the worker died inside a test
                    append_result(results, st[0], "failed", time.time() - float(st[1]),
                                  f"worker died (exit {proc.returncode}) during the test; see {results}.log")
                    new.append(st[0])
                elif not new:
                    start_failures += 1
                    print(f"worker exited {proc.returncode} before running a test (import failure?); "
                          f"see {results}.log; retry {start_failures}/5 in 60 s", flush=True)
                    if start_failures >= 5:
                        return 2
                    time.sleep(60)
                    continue
            start_failures = 0
            todo = [n for n in todo if n not in new]
    finally:
        log.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def done_names(res, names):
    return [n for n in names if n in res]


def summary(res: dict) -> str:
    counts = {o: 0 for o in OUTCOMES}
    for v in res.values():
        counts[v[-1][0]] += 1
    return f"{len(res)} tests: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES)


def compare(args) -> int:
    gloo_all, braid_all = read_results(args.gloo), read_results(args.braid)
    gloo = {n: v[-1] for n, v in gloo_all.items()}  # a test's last line counts
    braid = {n: v[-1] for n, v in braid_all.items()}
    gr = read_results(args.gloo_rerun) if args.gloo_rerun else {}
    br = read_results(args.braid_rerun) if args.braid_rerun else {}
    print(f"glooplugin ({args.gloo}): {summary(gloo_all)}")
    print(f"braid      ({args.braid}): {summary(braid_all)}")
    only_gloo = sorted(set(gloo) - set(braid))
    only_braid = sorted(set(braid) - set(gloo))
    if only_gloo or only_braid:
        print(f"not run on braid: {len(only_gloo)} {only_gloo[:20]}; not run on glooplugin: {len(only_braid)} {only_braid[:20]}")
    both_ran = [n for n in sorted(gloo) if n in braid]
    diff = [n for n in both_ran if gloo[n][0] == "passed" and braid[n][0] != "passed"]
    print(f"\n{len(diff)} tests pass on glooplugin but not on braid:")
    for n in diff:
        o, secs, msg = braid[n]
        line = f"  {n}: braid {o} ({secs:.0f} s): {msg}"
        if n in br or n in gr:
            ba = "/".join(x for x, _, _ in br.get(n, [])) or "-"
            ga = "/".join(x for x, _, _ in gr.get(n, [])) or "-"
            verdict = "consistent" if all(x == o for x, _, _ in br.get(n, [])) and all(x == "passed" for x, _, _ in gr.get(n, [])) else "FLAKY"
            line += f"\n      rerun: braid {ba}, glooplugin {ga} -> {verdict}"
            if n in br and br[n][-1][2] != msg:
                line += f"\n      braid rerun: {br[n][-1][2]}"
        print(line)
    other = [n for n in both_ran if gloo[n][0] != "passed" and braid[n][0] == "passed"]
    if other:
        print(f"\n{len(other)} tests pass on braid but not on glooplugin:")
        for n in other:
            print(f"  {n}: glooplugin {gloo[n][0]}: {gloo[n][2]}")
    bad = ("failed", "timeout")
    both = [n for n in both_ran if gloo[n][0] in bad and braid[n][0] in bad]
    if both:
        print(f"\n{len(both)} tests fail or time out on both:")
        for n in both:
            print(f"  {n}: glooplugin {gloo[n][0]}: {gloo[n][2][:200]}\n      braid {braid[n][0]}: {braid[n][2][:200]}")
    skew = [n for n in both_ran if (gloo[n][0] == "skipped") != (braid[n][0] == "skipped")]
    if skew:
        print(f"\n{len(skew)} tests skipped on one backend only:")
        for n in skew:
            print(f"  {n}: glooplugin {gloo[n][0]} {gloo[n][2][:100]} | braid {braid[n][0]} {braid[n][2][:100]}")
    if args.skip_reasons:
        reasons: dict[str, list[str]] = {}
        for n in both_ran:
            if gloo[n][0] == "skipped" and braid[n][0] == "skipped":
                r = braid[n][2].replace("braid", "BACKEND")
                r = re.sub(r"\{([^}]*)\}", lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", r)
                reasons.setdefault(r, []).append(n)
        print(f"\nskip reasons of the tests skipped on both ({sum(map(len, reasons.values()))}):")
        for r, ns in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(ns):4d}  {r}")
    if args.names_out:
        Path(args.names_out).write_text("".join(n + "\n" for n in diff))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def selection(p):
        p.add_argument("-k", action="append", default=[], help="substring or glob; several are or-ed")
        p.add_argument("--chunk", help="I/N: the I-th of N slices of the selection")
        p.add_argument("names", nargs="*", help="test names, or @FILE with names")

    p = sub.add_parser("list")
    selection(p)
    p = sub.add_parser("run")
    selection(p)
    p.add_argument("--backend", required=True, choices=BACKENDS)
    p.add_argument("--results", required=True)
    p.add_argument("--timeout", type=int, default=180, help="per-test limit in seconds (the suite's)")
    p.add_argument("--grace", type=int, default=120, help="watchdog: seconds past the limit before killing the worker")
    p.add_argument("--again", action="store_true", help="also run tests already in the results file")
    p = sub.add_parser("compare")
    p.add_argument("gloo")
    p.add_argument("braid")
    p.add_argument("--gloo-rerun")
    p.add_argument("--braid-rerun")
    p.add_argument("--names-out", help="write the names passing on glooplugin but not braid here")
    p.add_argument("--skip-reasons", action="store_true", help="also count the reasons of tests skipped on both")
    p = sub.add_parser("_worker")
    p.add_argument("--results", required=True)
    p.add_argument("--names-file", required=True)
    p.add_argument("--state-file", required=True)
    args = ap.parse_args(argv)

    if args.cmd == "list":
        print("\n".join(select(args)))
        return 0
    if args.cmd == "run":
        return run(args)
    if args.cmd == "compare":
        return compare(args)
    return _worker_main(args)


if __name__ == "__main__":
    sys.exit(main())
