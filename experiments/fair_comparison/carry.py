"""The settings a comparison picked so far, from its ledger, as a ``results.json`` that
``tfaploss compare --settings-from`` reads (for a tier that starts before the other
one has finished; the finished comparison's own results.json holds the same picks).

    python experiments/fair_comparison/carry.py LEDGER --budget images --images 65536 \\
        --batch-sizes 128,2048 --largest 2048 --updates 32 > carried.json
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tfaploss.compare.protocol import updates_for  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ledger")
    p.add_argument("--budget", default="images")
    p.add_argument("--images", type=int, required=True)
    p.add_argument("--updates", type=int, default=64)
    p.add_argument("--largest", type=int, required=True)
    p.add_argument("--batch-sizes", required=True)
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in Path(args.ledger).read_text().splitlines()
            if line.strip()]
    out = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        updates = updates_for(args.budget, batch, args.images, args.updates, args.largest)
        best = {}
        for r in rows:  # ledger order is trial order: a tie keeps the first, as tune()
            if r["batch"] == batch and r["updates"] == updates and not r["test"]:
                value = r.get("val_map@r") or 0.0
                if r["loss"] not in best or value > best[r["loss"]][0]:
                    best[r["loss"]] = (value, r["params"])
        out += [{"budget": args.budget, "batch": batch, "loss": loss, "params": params,
                 "val_map@r": value} for loss, (value, params) in sorted(best.items())]
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
