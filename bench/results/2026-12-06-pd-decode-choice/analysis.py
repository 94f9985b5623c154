"""The README's per-seed blocks table (t intervals over seeds) and the decision counts.

python bench/results/2026-12-06-pd-decode-choice/analysis.py DIR SEEDS
(DIR: this folder or its dev/, SEEDS: 10,11,12 or 0,1,2)
"""

import gzip
import json
import math
import statistics as st
import sys
from pathlib import Path

T975_2DF = 4.303  # Student t, 97.5th percentile, 2 degrees of freedom (three seeds)


def main(base: Path, seeds: list[int], ref: str = "kvroute") -> None:
    blocks: dict[str, dict[int, float]] = {}
    for s in seeds:
        rows = json.loads((base / f"seeds/seed{s}/routing_dense_pd.json").read_text())["routers"]
        for r in rows if isinstance(rows, list) else rows.values():
            blocks.setdefault(r.get("router") or r["name"], {})[s] = r["pd"][
                "kv_blocks_per_request"
            ]
    print("| router | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | ref minus router |")
    for name, v in blocks.items():
        xs = [v[s] for s in seeds]
        ci = ""
        if name != ref:
            ds = [blocks[ref][s] - v[s] for s in seeds]
            m, h = st.mean(ds), T975_2DF * st.stdev(ds) / math.sqrt(len(ds))
            ci = f"{m:+.1f} [{m - h:+.1f}, {m + h:+.1f}]"
        print(
            f"| {name} | " + " | ".join(f"{x:.1f}" for x in xs) + f" | {st.mean(xs):.1f} | {ci} |"
        )
    for name in (ref, "kvroute-pd-running-2ms"):
        differ = most = 0
        for s in seeds:
            path = base / f"seeds/seed{s}/runs/routing_dense_pd/{name}.decisions.jsonl.gz"
            n = pred = 0
            with gzip.open(path, "rt") as f:
                lines = list(f)
            for line in lines:
                d = json.loads(line)
                pd = d.get("pd")
                if not pd or not pd.get("decode"):
                    continue
                cands = pd["decode_candidates"]
                chosen = next(c for c in cands if c["worker"] == pd["decode"][0]["worker"])
                n += 1
                p, hit = d["prompt_tokens"], d["prompt_tokens"] - chosen["uncached_tokens"]
                # blocks as the simulated decode engine counts a pull
                pred += (math.ceil(p / 16) - hit // 16) if chosen["uncached_tokens"] else 0
                if len({c["predicted_reuse"] for c in cands}) > 1:
                    differ += 1
                    top = max(c["predicted_reuse"] or 0 for c in cands)
                    most += (chosen["predicted_reuse"] or 0) == top
            print(f"{name} seed {s}: {n} decisions, predicted blocks/request {pred / n:.1f}")
        print(f"{name}: took the most predicted reuse in {most} of {differ} differing choices")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")])
