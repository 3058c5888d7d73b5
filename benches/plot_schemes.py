"""Plots each scheme's encode time against the memory floor (the in-place
r += g loop of the same run) from saved outputs of `cargo bench --bench
schemes`: one bar per scheme and file, the ratio averaged over the runs a
file holds, with the issue-15 targets drawn across.

  cargo bench --bench schemes > after.txt    # as many runs as you like, appended
  python benches/plot_schemes.py before.txt after.txt --out docs/schemes.png

Needs matplotlib (pip install 'matplotlib<3.8' 'numpy<1.24': without the numpy
pin pip upgrades numpy past what MXNet 1.9.1 imports; not part of the project's
environment); without it the averaged table is printed and no plot made."""
import argparse
import os
import re
import sys

# A row's name has no run of two spaces (the columns' separator), so a row
# whose encode columns are dashes (the copy's) does not match through them.
ROW = re.compile(r"^(?P<name>\S(?:(?!\s{2}).)*)\s{2,}(?P<enc>[\d.]+)\s+[\d.]+\s+(?P<ratio>[\d.]+)x")


def runs(path):
    """The encode/loop ratios of every run in one file: [{scheme: ratio}]."""
    out = []
    with open(path) as f:
        for line in f:
            m = ROW.match(line.rstrip())
            if not m:
                continue
            name = m.group("name").strip()
            if name.startswith("r += g"):
                out.append({})
            elif out:
                out[-1][name] = float(m.group("ratio"))
    return [r for r in out if r]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="saved bench outputs, one label each (the file name)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "schemes.png"))
    args = p.parse_args()
    series = []
    for path in args.files:
        rs = runs(path)
        if not rs:
            sys.exit("%s: no `cargo bench --bench schemes` table found" % path)
        names = [n for n in rs[0] if all(n in r for r in rs)]
        series.append((os.path.splitext(os.path.basename(path))[0], len(rs), {n: sum(r[n] for r in rs) / len(rs) for n in names}))
    # the 2-bit rows and the floors of the 2-bit paths (read pass, three arrays) are not schemes here
    schemes = [n for n in series[0][2] if all(n in s[2] for s in series) and not n.startswith(("2bit", "read r, g", "next = r + g"))]
    print("encode time / r += g loop, mean over runs")
    print("| scheme | " + " | ".join("%s (%d runs)" % (label, k) for label, k, _ in series) + " |")
    print("|---|" + "---|" * len(series))
    for n in schemes:
        print("| %s | " % n + " | ".join("%.2fx" % s[2][n] for s in series) + " |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(series)
    for k, (label, count, ratios) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(schemes))]
        ax.bar(xs, [ratios[n] for n in schemes], width, label="%s (%d runs)" % (label, count))
    ax.axhline(1.0, color="black", linewidth=1, label="floor: r += g loop")
    ax.axhline(1.5, color="green", linestyle="--", linewidth=1, label="target 1.5x")
    ax.axhline(2.5, color="orange", linestyle=":", linewidth=1, label="target 2.5x (_ts, _ms)")
    ax.axhline(3.0, color="red", linestyle="-.", linewidth=1, label="target 3x (PowerSGD)")
    ax.set_xticks(range(len(schemes)))
    ax.set_xticklabels(schemes, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("encode time / r += g loop (lower is better)")
    ax.set_title("Scheme encode against the memory floor (16 Mi float32, 2 threads)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("plot:", os.path.abspath(args.out))


if __name__ == "__main__":
    main()
