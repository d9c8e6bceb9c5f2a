"""Code rewards and `rlhf eval` pass@k cannot be gamed: the model's code runs in one sandboxed process, the
tests and the verdict in another (the real launcher and harness). A wrong solution that hunts for a success
token, forges verdict lines, returns an always-equal object, raises, hangs, crashes or floods its output
scores 0; a correct one scores 1."""

from __future__ import annotations

import json
import time

import pytest

from rlhf.eval.code import unit_test_pass_rate
from rlhf.eval.run import EvalOptions, _code
from rlhf.eval.tasks import load_task
from workers.sandbox import SandboxLimits
from workers.sandbox.verdict import CodeCheck, run_check, run_checks
from workers.sandbox.verdict_harness import Unplain, decode, encode

FAST = SandboxLimits(wall_s=3.0, cpu_s=2.0, memory_mb=256)
TESTS = ["assert square(2) == 4", "assert square(-3) == 9", "assert abs(square(1.5) - 2.25) < 1e-9"]
GOOD = "def square(x):\n    return x * x\n"

# Reads everything it can reach (its own script, the folders around it, every visible process's command line
# and environment, its stdin and descriptors), prints every token-like string, writes verdict-looking lines
# to descriptors 1..20 and exits 0 before any test could run.
STEAL = r'''
import os, re, sys
found = []
def grab(path):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            found.extend(re.findall(rb"[0-9a-f]{32}", os.read(fd, 1 << 20)))
        finally:
            os.close(fd)
    except OSError:
        pass
for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["self", str(os.getppid())]:
    for leaf in ("cmdline", "environ"):
        grab(f"/proc/{pid}/{leaf}")
for fd in os.listdir("/proc/self/fd"):
    grab(f"/proc/self/fd/{fd}")
found.extend(re.findall(rb"[0-9a-f]{32}", repr(dict(os.environ)).encode() + sys.stdin.buffer.read(1 << 16)))
for top in {"/tmp", os.path.expanduser("~"), os.path.realpath(".."), "."} - {"/"}:
    for folder, _, files in os.walk(top):
        for name in files:
            grab(os.path.join(folder, name))
verdicts = [{"result": i, "passed": True} for i in range(10)] + [{"done": True}] + [{"id": i, "ok": 4} for i in range(5)]
lines = [str(v).replace("'", '"').replace("True", "true").encode() + b"\n" for v in verdicts] + [b"PASS\n"]
lines += [t + b"\n" for t in dict.fromkeys(found)]  # the tokens last: a token printed last was a pass
for fd in range(1, 21):
    for line in lines:
        try:
            os.write(fd, line)
        except OSError:
            break
os._exit(0)
'''

# An object every comparison, arithmetic or truth test calls a match.
ALWAYS_EQUAL = '''
class Anything(float):
    def __new__(cls, *a):
        return float.__new__(cls, 0.0)
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __hash__(self): return 0
    def __bool__(self): return True
    def __float__(self): return 0.0
    def __sub__(self, other): return self
    __rsub__ = __add__ = __radd__ = __mul__ = __rmul__ = __truediv__ = __sub__
    def __abs__(self): return -1.0
    def __lt__(self, other): return True
    __le__ = __gt__ = __ge__ = __lt__
    def __round__(self, n=None): return self

def square(x):
    return Anything()
'''

HUMANEVAL_ROW = {"task_id": "T/0", "entry_point": "square",
                 "prompt": "def helper(x):\n    return x * x\n\n\ndef square(x):\n    \"\"\"x squared.\"\"\"\n",
                 "test": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-3) == helper(-3)\n"
                         "    assert abs(candidate(1.5) - 2.25) < 1e-9\n",
                 "canonical_solution": "    return x * x\n"}
MBPP_ROW = {"task_id": 1, "text": "Square a number.", "code": GOOD, "test_list": TESTS,
            "test_setup_code": "import math"}


def _code_task(tmp_path, row):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return load_task(f"code:{path}")


def _pass_at_1(tmp_path, row, completion: str) -> float:
    task = _code_task(tmp_path, row)
    metrics, _ = _code(task, [[completion]], EvalOptions(sandbox=SandboxLimits(wall_s=5.0, cpu_s=3.0),
                                                          progress=False))
    return metrics["pass@1"]["value"]


def _fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def test_token_hunting_and_forged_verdict_lines_score_zero(tmp_path):
    assert unit_test_pass_rate(None, _fenced(STEAL), TESTS) == 0.0
    assert _pass_at_1(tmp_path, MBPP_ROW, _fenced(STEAL)) == 0.0
    assert _pass_at_1(tmp_path, HUMANEVAL_ROW, "    return None\n" + STEAL) == 0.0


def test_always_equal_objects_score_zero(tmp_path):
    assert unit_test_pass_rate(None, _fenced(ALWAYS_EQUAL), TESTS) == 0.0
    assert _pass_at_1(tmp_path, MBPP_ROW, _fenced(ALWAYS_EQUAL)) == 0.0
    body = "    return Anything()\n" + ALWAYS_EQUAL.replace("def square(x):\n    return Anything()\n", "")
    assert _pass_at_1(tmp_path, HUMANEVAL_ROW, body) == 0.0


def test_correct_solutions_score_one(tmp_path):
    assert unit_test_pass_rate(None, "Here:\n" + _fenced(GOOD), TESTS) == 1.0
    assert _pass_at_1(tmp_path, MBPP_ROW, _fenced(GOOD)) == 1.0
    assert _pass_at_1(tmp_path, HUMANEVAL_ROW, HUMANEVAL_ROW["canonical_solution"]) == 1.0


def test_one_failing_test_does_not_hide_the_others():
    half = "def square(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x * x\n"
    assert unit_test_pass_rate(None, half, TESTS) == pytest.approx(2 / 3)


def test_raising_hanging_and_crashing_candidates_score_zero_within_the_wall_clock():
    cases = {"raises": "def square(x):\n    raise ValueError(x)\n",
             "hangs at load": "import time\ntime.sleep(60)\n" + GOOD,
             "hangs in a call": "import time\ndef square(x):\n    time.sleep(60)\n",
             "spins": "def square(x):\n    while True:\n        pass\n",
             "segfaults": "import ctypes\ndef square(x):\n    return ctypes.string_at(0)\n",
             "exits": "import os\ndef square(x):\n    os._exit(0)\n",
             "no function": "x = 1\n"}
    limits = SandboxLimits(wall_s=1.5, cpu_s=1.0, memory_mb=256)
    for name, code in cases.items():
        t0 = time.monotonic()
        r = run_check(CodeCheck(code, tuple(TESTS[:1])), limits)
        assert r.passed == [False], (name, r)
        assert time.monotonic() - t0 < limits.wall_s + 6, (name, r)  # one wall clock, the grace and start-up
        assert r.status == {"raises": "ok", "no function": "ok", "segfaults": "crashed", "exits": "exited"}.get(
            name, r.status), (name, r)


def test_a_hang_in_one_test_leaves_the_others_their_verdicts():
    code = "import time\ndef square(x):\n    if x < 0:\n        time.sleep(60)\n    return x * x\n"
    r = run_check(CodeCheck(code, tuple(TESTS)), FAST)
    assert r.passed == [True, False, True] and r.status == "timeout", r


def test_a_flood_of_output_does_not_break_the_protocol():
    code = ("import os, sys\nprint('x' * 3_000_000)\n"
            "def square(x):\n    print('{\"id\": 1, \"ok\": 0}\\n' * 20000)\n    sys.stderr.write('e' * 2_000_000)\n"
            "    os.write(1, b'noise\\n' * 1000)\n    return x * x\n")
    r = run_check(CodeCheck(code, tuple(TESTS)), SandboxLimits(wall_s=20.0, cpu_s=10.0))
    assert r.passed == [True, True, True], r


def test_exceptions_a_test_expects_cross_but_never_stop_iteration():
    expects = "try:\n    square(-1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no ValueError')"
    raises = "def square(x):\n    raise ValueError(x)\n"
    assert run_check(CodeCheck(raises, (expects,)), FAST).passed == [True]
    stops = "def square(x):\n    raise StopIteration\n"  # would end all(map(...)) early, as if every item passed
    assert run_check(CodeCheck(stops, ("assert all(map(lambda x: square(x) == 7, [1, 2]))",)), FAST).passed == [False]


def test_modules_and_values_the_candidate_defines_reach_the_tests():
    code = "import math\nLIMIT = 3\ndef root(x):\n    return math.sqrt(x)\n"
    tests = ("assert math.isclose(root(2.0), 2 ** 0.5)", "assert LIMIT == 3", "assert root(LIMIT) ** 2 > 2.9")
    assert run_check(CodeCheck(code, tests), FAST).passed == [True, True, True]
    liar = "import json as math\ndef root(x):\n    return 0\n"  # a module under another name does not bind
    assert run_check(CodeCheck(liar, tests[:1]), FAST).passed == [False]


def test_a_builtin_the_candidate_shadows_stays_the_builtin():
    code = "def abs(x):\n    return 0\ndef square(x):\n    return 99\n"
    assert run_check(CodeCheck(code, (TESTS[2],)), FAST).passed == [False]


def test_checks_sharing_a_checker_keep_their_own_verdicts():
    """run_checks reuses a checker process across checks: each still gets its own candidate and verdict."""
    codes = [GOOD, ALWAYS_EQUAL, STEAL, "def square(x):\n    raise ValueError(x)\n", GOOD, "LIMIT = 1\n", GOOD]
    results = run_checks([CodeCheck(c, tuple(TESTS)) for c in codes], FAST, workers=2)
    assert [all(r.passed) for r in results] == [True, False, False, False, True, False, True], results


def test_plain_values_round_trip_and_nothing_else_crosses():
    values = [None, True, 3, -2**200, 1.5, float("inf"), "s\n\r\"", b"\x00\xff", [1, (2, 3)], {1: {"a": [None]}},
              {1, 2}, frozenset({"x"}), (), {}]
    for v in values:
        assert decode(json.loads(json.dumps(encode(v)))) == v
    nan = decode(json.loads(json.dumps(encode(float("nan")))))
    assert nan != nan
    for bad in (object(), type("S", (str,), {})("x"), [lambda: 1], iter([1]), {1: object()}):
        with pytest.raises(Unplain):
            encode(bad)
    for bad in ({"tuple": [1], "set": []}, {"eval": "1"}, {"bytes": 3}, {"dict": [[1]]}):
        with pytest.raises(ValueError):
            decode(bad)


def test_a_candidate_over_its_memory_bound_is_named_memory():
    """Children and the candidate together go over memory_mb: under a cgroup the kernel kills inside the call
    and the check says `memory` (its cgroup read and removed); under per-process limits the allocation fails.
    Either way the wrong-by-exhaustion candidate does not pass."""
    from workers.sandbox.sandbox import memory_bound_mode

    code = ("import os, time\ndef square(x):\n    for _ in range(3):\n        if os.fork() == 0:\n"
            "            b = b'k' * (100 << 20)\n            time.sleep(30)\n            os._exit(0)\n"
            "    b = b'm' * (180 << 20)\n    time.sleep(30)\n    return x * x\n")
    r = run_check(CodeCheck(code, tuple(TESTS[:1])), SandboxLimits(wall_s=8.0, cpu_s=5.0, memory_mb=256))
    assert r.passed == [False], r
    if memory_bound_mode().startswith("cgroup"):
        assert r.status == "memory", r
