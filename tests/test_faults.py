"""Loggers under real faults: a process killed by the file-size limit in the middle of a
record (a real partial write, as on a full disk), and readers given files that are not what
a logger writes. Every reference is computed here from what the child was asked to write."""

import json
import resource
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import eqx_logs
from eqx_logs.loggers import JsonlLogger, read_jsonl

_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    import eqx_logs
    from eqx_logs.loggers import JsonlLogger

    logger = JsonlLogger(sys.argv[1], fsync_every=0)
    for i in range(100_000):
        logs = eqx_logs.LogDict({"value": np.float32(i)}, count={"value": np.int32(1)})
        logger.write(logs)
        logger.flush()
    """
)


def _limited(limit: int):
    def set_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def test_jsonl_resumes_after_a_write_cut_short(tmp_path):
    path = tmp_path / "l.jsonl"
    limit = 4000  # bytes: the child's write stops in the middle of a record
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        preexec_fn=_limited(limit),
        capture_output=True,
        timeout=120,
    )
    # Python ignores SIGXFSZ: the write fails with EFBIG, as with ENOSPC on a full disk
    assert child.returncode == 1 and b"File too large" in child.stderr, child.stderr[-2000:]
    data = path.read_bytes()
    assert len(data) == limit and not data.endswith(b"\n")  # a torn last line
    whole = data[: data.rindex(b"\n") + 1].decode().splitlines()
    assert read_jsonl(path) == [json.loads(line) for line in whole]

    with pytest.warns(UserWarning, match="cut short"):
        with JsonlLogger(path) as logger:
            logger.write(eqx_logs.LogDict({"after": np.float32(-1.0)}, count={"after": 1}))
    rows = read_jsonl(path)
    assert [r["value"] for r in rows[:-1]] == [float(i) for i in range(len(whole))]
    assert (rows[-1]["key"], rows[-1]["value"]) == ("after", -1.0)
    assert path.read_bytes().startswith(data[: data.rindex(b"\n") + 1])


@pytest.mark.parametrize(
    "lines, line, message",
    [
        (
            ['{"run": 0, "key": "a", "value": 1}', "{oops", '{"run": 0, "key": "a", "value": 2}'],
            2,
            "not JSON",
        ),
        (['{"run": 0, "key": "a", "value": 1}', "1"], 2, "not a JsonlLogger record"),
        (["null"], 1, "not a JsonlLogger record"),
        (['{"key": "a"}'], 1, "not a JsonlLogger record"),
    ],
)
def test_read_jsonl_names_the_file_and_line(tmp_path, lines, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl, line {line}: {message}"):
        read_jsonl(path)


def test_read_jsonl_skips_only_a_torn_last_line(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text('{"run": 0, "key": "a", "value": 1}\n{"run": 0, "key": "a", "va')
    assert read_jsonl(path) == [{"run": 0, "key": "a", "value": 1}]


@pytest.mark.parametrize("name", ["key", "value", "run", "count"])
def test_reserved_step_names_are_rejected_at_the_call_site(name):
    def f(x):
        eqx_logs.log("loss", x, **{name: 7})
        return x

    with pytest.raises(ValueError, match=rf"step name '{name}' at .*test_faults\.py.*reserved"):
        eqx_logs.spool(f)(np.float32(0.25))
