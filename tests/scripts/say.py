import os, sys
r = os.environ["LOCAL_RANK"]
print(f"hello out {r}", flush=True)
print(f"hello err {r}", file=sys.stderr, flush=True)
if os.environ.get("SAY_INIT") == "1":  # join the world: PHOENIX's own lines ("generation 0: arrived") are logged
    import phoenix_runtime as phx

    phx.init()
    print(f"joined {r}", flush=True)
