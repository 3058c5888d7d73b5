"""What torch_ddp.py and torch_fsdp.py share: the schemes every test runs
(one setting each), and what a rank reports of a call that should fail."""
import json
import os
import sys

import gradpack

SCHEMES = [
    {"compress": "none"},
    {"compress": "2bit", "threshold": 0.05},
    {"compress": "qsgd_mn", "bits": 2, "seed": 4},
    {"compress": "qsgd_mn_ts", "bits": [2, 6]},
    {"compress": "qsgd_mn_ms", "bits": [1, 3, 8]},
    {"compress": "grandk_mn", "bits": 4, "k": 40},
    {"compress": "grandk_mn_ts", "bits": [2, 4], "k": 60},
    {"compress": "powersgd", "rank": 2},
    {"compress": "1bit", "threshold": 0.01},
]


def error_of(fn):
    """'gradpack.Error: <text>' (or another exception's type and text) of
    calling `fn`; None when it returns."""
    try:
        fn()
    except gradpack.Error as e:
        return "gradpack.Error: " + str(e)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return "%s: %s" % (type(e).__name__, e)
    return None


def write_report(scenarios, rank, world):
    """Runs the scenarios named in argv (`scenarios['scenario_<name>']`)
    and writes rank<r>.json with what each returned into
    GRADPACK_TEST_OUT."""
    report = {"rank": rank, "world": world}
    for name in sys.argv[1:]:
        report[name] = scenarios["scenario_" + name]()
    with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "rank%d.json" % rank), "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
