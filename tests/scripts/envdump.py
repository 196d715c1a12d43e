import json, os, sys
out = sys.argv[1]
with open(os.path.join(out, f"env.{os.environ['RANK']}.json"), "w") as f:
    json.dump(dict(os.environ), f)
