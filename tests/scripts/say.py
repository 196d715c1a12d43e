import os, sys
r = os.environ["LOCAL_RANK"]
print(f"hello out {r}", flush=True)
print(f"hello err {r}", file=sys.stderr, flush=True)
