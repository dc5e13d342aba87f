"""Cache file names (workbench/registry.fingerprint: packs and exported GGUFs): two models never share one."""
import os

from workbench.registry import fingerprint

SAME_TIME = (1_700_000_000_000_000_000, 1_700_000_000_000_000_000)


def twins(tmp_path, name):
    """Two files named alike in two folders, same size, same mtime, different bytes."""
    out = []
    for folder, fill in (("a", b"\1"), ("b", b"\2")):
        p = tmp_path / folder / name
        p.parent.mkdir()
        p.write_bytes(fill * 64)
        os.utime(p, ns=SAME_TIME)
        out.append(p)
    return out


def test_two_ggufs_with_the_same_name_size_and_time_get_their_own_packs(tmp_path):
    """The tiny Qwen3.5-MoE and MiniCPM-V 4.7 language models, exported in the same second as m.gguf in two
    folders, have the same size: alike fingerprints would run the second on the first one's pack."""
    a, b = twins(tmp_path, "m.gguf")
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) == fingerprint(a)          # and the same model keeps its pack


def test_two_model_folders_alike_in_names_sizes_and_times_get_their_own_ggufs(tmp_path):
    a, b = twins(tmp_path, "config.json")
    assert fingerprint(a.parent) != fingerprint(b.parent)
    assert fingerprint(a.parent) == fingerprint(a.parent)
