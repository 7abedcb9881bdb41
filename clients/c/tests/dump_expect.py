"""Write the table the C tests read: where each expert part of a model lies in its files.

    python dump_expect.py MODEL OUT

Lines: ``file <i> <path>`` then ``x <layer> <expert> <part> <file> <offset> <bytes>``.
"""
import sys

from moecached.engine.index import open_index


def main(model: str, out: str) -> None:
    idx = open_index(model)
    with open(out, "w") as f:
        for i, p in enumerate(idx.files):
            f.write(f"file {i} {p}\n")
        for layer in idx.expert_layers:
            for e in range(idx.n_experts):
                for s in idx.parts(layer, e):
                    f.write(f"x {layer} {e} {s.part} {s.file} {s.offset} {s.nbytes}\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
