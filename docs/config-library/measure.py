"""Import-time cost of pydantic-settings on `kvrouter serve` start-up (fresh interpreters).

    .venv/bin/pip install pydantic-settings     # not a kvrouter dependency
    .venv/bin/python docs/config-library/measure.py .venv/bin/python 9
"""
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 7

def top_level(code):
    p = subprocess.run([PY, "-X", "importtime", "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": HERE})
    out = {}
    for line in p.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cum, name = line.split("|")
        if name[1:2] != " ":  # top level: one space after the bar
            out[name.strip()] = out.get(name.strip(), 0) + int(cum)
    return out

rows = {"serve imports (router.service.app + config)": [], "pydantic_settings + the prototype's models, after those": [], "router.service.config alone (fresh)": [], "the prototype alone (fresh)": []}
for _ in range(N):
    a = top_level("import router.service.app, router.service.config")
    rows["serve imports (router.service.app + config)"].append(sum(a.values()))
    b = top_level("import router.service.app, router.service.config; import pyd_config")
    rows["pydantic_settings + the prototype's models, after those"].append(b["pyd_config"])
    c = top_level("import router.service.config")
    rows["router.service.config alone (fresh)"].append(c["router.service.config"])
    d = top_level("import pyd_config")
    rows["the prototype alone (fresh)"].append(d["pyd_config"])
for k, v in rows.items():
    print(f"{k}: median {statistics.median(v)/1e3:.1f} ms (min {min(v)/1e3:.1f}, max {max(v)/1e3:.1f}, n={len(v)})")
walls = []
for _ in range(N):
    t = time.perf_counter()
    subprocess.run([PY, "-m", "router.cli", "serve", "--replica", "m=http://127.0.0.1:9", "--check"], capture_output=True, check=True)
    walls.append(time.perf_counter() - t)
print(f"kvrouter serve --check wall: median {statistics.median(walls)*1e3:.0f} ms (min {min(walls)*1e3:.0f}, n={N})")
