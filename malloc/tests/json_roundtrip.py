"""A JSON round trip of generated records, the python program that .ci/malloc.sh and
malloc/bench.py run on each allocator: prints the text's digest and length. Where
libthiscpu_malloc is loaded, its own answer (whether its caches served the program) goes to
standard error, so that the output is the same on every allocator.

Usage: python3 malloc/tests/json_roundtrip.py [RECORDS]   (60,000 by default)
"""

import ctypes
import hashlib
import json
import random
import sys

count = int(sys.argv[1]) if len(sys.argv) > 1 else 60000
random.seed(7)
records = [{"id": i, "name": "".join(random.choice("abcdefgh") for _ in range(i % 40)),
            "tags": [random.random() for _ in range(i % 13)], "nested": {"n": i, "s": str(i) * 3}}
           for i in range(count)]
text = json.dumps(records, sort_keys=True)
assert json.loads(text) == records
print(hashlib.sha256(text.encode()).hexdigest(), len(text))
library = ctypes.CDLL(None)
if hasattr(library, "thiscpu_malloc_caching"):
    print("caching", library.thiscpu_malloc_caching(),
          "served", library.thiscpu_malloc_slow_calls() > 0, file=sys.stderr)
