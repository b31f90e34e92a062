"""A bench child that reports one partial result, then is killed (tests/test_bench.py)."""

import json
import os
import signal
import sys

from edge0.bench.child import RESULT_PREFIX

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(RESULT_PREFIX + json.dumps({"status": "partial", "rows": spec["rows"]}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
