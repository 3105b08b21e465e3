import numpy as np
import pytest
import torch

from crucible.config import Config
from crucible.data import Corpus, ShardReader, load_tokens
from crucible.model import build_stage, split_layers


def test_reader_is_a_pure_function_of_step_and_resumes_exactly():
    toks = np.arange(10_000, dtype=np.uint16) % 256
    a = ShardReader(toks, replica=1, replicas=2, seq_len=16, seed=3)
    seq = [a.next_batch(4) for _ in range(30)]  # crosses a pass boundary
    b = ShardReader(toks, replica=1, replicas=2, seq_len=16, seed=3)
    b.next_batch(4)
    state = b.state_dict()
    c = ShardReader(toks, replica=1, replicas=2, seq_len=16, seed=3)
    c.load_state_dict(state)
    for want in seq[1:]:
        got = c.next_batch(4)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="replica"):
        ShardReader(toks, replica=0, replicas=2, seq_len=16, seed=3).load_state_dict(state)


def test_replica_shards_are_disjoint():
    toks = np.arange(4000, dtype=np.uint16)
    r0 = ShardReader(toks, 0, 2, 8, 0)
    r1 = ShardReader(toks, 1, 2, 8, 0)
    assert set(r0.tokens.tolist()).isdisjoint(r1.tokens.tolist())


def test_sources(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_bytes(b"world")
    (tmp_path / "d" / "a.txt").write_bytes(b"hello ")
    assert bytes(load_tokens(str(tmp_path / "d"), 1 << 20)) == b"hello world"
    (tmp_path / "t.bin").write_bytes(np.array([1, 2, 300], dtype="<u2").tobytes())
    assert load_tokens(str(tmp_path / "t.bin"), 1 << 20, vocab_size=512).tolist() == [1, 2, 300]
    with pytest.raises(ValueError, match="vocab_size"):
        load_tokens(str(tmp_path / "t.bin"), 1 << 20, vocab_size=256)
    with pytest.raises(ValueError, match="no such file"):
        load_tokens(str(tmp_path / "missing"), 1 << 20)


def test_a_max_bytes_beyond_memory_reads_what_there_is(tmp_path):
    # one f.read(max_bytes) allocated all of it first: MemoryError for 1 TB, OverflowError near 2**63
    (tmp_path / "t.txt").write_bytes(b"hello world")
    for cap in (1 << 40, 2**63 - 1):
        assert load_tokens(str(tmp_path / "t.txt"), cap).tobytes() == b"hello world"
    assert load_tokens(str(tmp_path / "t.txt"), 5).tobytes() == b"hello"


def test_builtin_corpus_is_deterministic():
    cfg = Config.load(None, ["data.max_bytes=300000"])
    a, b = Corpus(cfg), Corpus(cfg)
    assert np.array_equal(a.train, b.train) and len(a.eval) > 0


def test_validation_and_test_windows_are_disjoint_halves_of_the_held_out_tail():
    from crucible.data import eval_batches
    cfg = Config.load(None, ["data.max_bytes=300000"])
    c = Corpus(cfg)
    val, test = c.held_out("validation"), c.held_out("test")
    assert np.array_equal(np.concatenate([val, test]), c.eval) and np.array_equal(c.held_out("all"), c.eval)
    # the windows evaluated come from the split named, not from the other half
    (xv, _), = eval_batches(val, 16, 4, 1)
    (xt, _), = eval_batches(test, 16, 4, 1)
    assert not torch.equal(xv, xt)
    with pytest.raises(ValueError, match="train.eval_split"):
        Config.load(None, ["train.eval_split=heldout"])


def test_stage_split_does_not_change_initial_weights():
    cfg1 = Config.load(None, ["job.stages=1", "model.n_layer=4", "model.d_model=32", "model.n_head=2"])
    whole = dict(build_stage(cfg1, 0, 1).named_parameters())
    cfg4 = Config.load(None, ["job.stages=4", "model.n_layer=4", "model.d_model=32", "model.n_head=2"])
    parts = {}
    for s in range(4):
        parts.update(dict(build_stage(cfg4, s, 4).named_parameters()))
    assert sorted(parts) == sorted(whole)
    for n, p in whole.items():
        assert torch.equal(p, parts[n]), n
    assert [list(r) for r in split_layers(10, 4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_boundaries_carry_the_residual_stream():
    cfg = Config.load(None, ["job.stages=3", "model.n_layer=3", "model.d_model=32", "model.n_head=2",
                             "train.seq_len=16"])
    stages = [build_stage(cfg, s, 3) for s in range(3)]
    h = stages[0](torch.zeros(2, 16, dtype=torch.int64))
    assert h.shape == (2, 16, 32)
    # skipping the inner stage still gives a valid input to the last one (identity of the residual stream)
    assert stages[2](h).shape == (2, 16, 32)
    assert stages[2].loss(stages[2](stages[1](h)), torch.zeros(2, 16, dtype=torch.int64)).ndim == 0


def test_a_fifo_or_a_device_is_refused_not_read(tmp_path):
    """A FIFO blocked the pre-flight (and every stage-0 worker) forever in open();
    /dev/zero trained on zeros. Each is one line naming it, at once."""
    import os
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_bytes(b"hello world " * 100)
    os.mkfifo(tmp_path / "d" / "p")
    got = {}

    def load(key, path):
        try:
            load_tokens(path, 1 << 20)
        except ValueError as e:
            got[key] = str(e)

    threads = [threading.Thread(target=load, args=a, daemon=True)
               for a in (("fifo", str(fifo)), ("folder", str(tmp_path / "d")), ("zero", "/dev/zero"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for p in (fifo, tmp_path / "d" / "p"):      # (release a reader stuck in open(), if any)
        try:
            os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert got.get("fifo") == f"data.path {str(fifo)!r}: a FIFO, not a file or a folder of files", got
    assert got.get("folder") == f"data.path: {str(tmp_path / 'd' / 'p')!r} in the folder is a FIFO, not a file of text"
    assert got.get("zero") == "data.path '/dev/zero': a character device, not a file or a folder of files"


def test_a_bin_file_is_read_up_to_max_bytes(tmp_path):
    """data.max_bytes caps a .bin as it caps text (it was read whole: a 200 GB
    sparse file with data.max_bytes=100000 was a MemoryError)."""
    (tmp_path / "t.bin").write_bytes(np.arange(1000, dtype="<u2").tobytes())
    assert load_tokens(str(tmp_path / "t.bin"), 101, vocab_size=1024).tolist() == list(range(50))
    assert load_tokens(str(tmp_path / "t.bin"), 1 << 40, vocab_size=1024).size == 1000
    (tmp_path / "odd.bin").write_bytes(b"\x01" * 2001)     # a damaged file is said whatever the cap
    with pytest.raises(ValueError, match=r"its size \(2001 bytes\) is odd"):
        load_tokens(str(tmp_path / "odd.bin"), 100)


def test_a_folder_that_cannot_be_listed_is_named(tmp_path, monkeypatch):
    """os.walk skips a folder it cannot list: an unreadable data.path was 'the
    folder holds no files (empty corpus)', an unreadable subfolder was left out
    of the corpus without a word."""
    import os

    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_bytes(b"hello ")
    (tmp_path / "d" / "sub" / "b.txt").write_bytes(b"world")
    real = os.scandir

    def scandir(path="."):
        if os.fspath(path).endswith("sub"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(ValueError) as e:
        load_tokens(str(tmp_path / "d"), 1 << 20)
    assert str(e.value) == f"data.path: cannot read the folder {str(tmp_path / 'd' / 'sub')!r}: Permission denied"


def _corpus(tmp_path, payload: bytes, *overrides) -> Corpus:
    (tmp_path / "c.txt").write_bytes(payload)
    return Corpus(Config.load(None, ["train.seq_len=16", f"data.path={tmp_path / 'c.txt'}", *overrides]))


def test_corpus_change_names_what_the_checkpoint_read_and_what_this_job_reads(tmp_path):
    from crucible.corpus import corpus_change

    text = bytes(range(32, 127)) * 40
    saved = _corpus(tmp_path, text).fingerprint()
    assert saved["tokens"] == len(text) and saved["path"] == str(tmp_path / "c.txt")
    assert corpus_change(saved, _corpus(tmp_path, text).fingerprint()) is None            # the same data
    assert corpus_change(None, saved) is None and corpus_change({}, saved) is None       # recorded none
    changed = _corpus(tmp_path, text[:-1] + b"!").fingerprint()                          # same size, one byte
    why = corpus_change(saved, changed)
    assert why.startswith(f"it was trained on other data (data.path {str(tmp_path / 'c.txt')!r}, 3,800 tokens "
                          f"(3,724 for training), sha256 {saved['sha256'][:12]}) than this job reads"), why
    assert "data.allow_new_corpus=true" in why and changed["sha256"][:12] in why
    assert corpus_change(saved, changed, allow=True) is None
    assert corpus_change(saved, _corpus(tmp_path, text, "data.max_bytes=3000").fingerprint())   # a shorter cap
    assert corpus_change(saved, _corpus(tmp_path, text, "data.eval_fraction=0.1").fingerprint())  # another split
    builtin = Corpus(Config.load(None, ["data.max_bytes=300000"])).fingerprint()
    assert "than this job reads (the built-in corpus, 300,000 tokens" in corpus_change(saved, builtin)


def test_a_data_path_and_tls_files_under_home_written_with_a_tilde(tmp_path, monkeypatch):
    """`data.path=~/corpus.txt` (no shell expands ~ after '='): 'no such file
    or folder'. A leading ~ is the home of the host that reads the file."""
    from crucible import tls
    from crucible.certs import make

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus.txt").write_bytes(b"hello")
    assert bytes(load_tokens("~/corpus.txt", 1 << 20)) == b"hello"
    make(str(tmp_path / "certs"), ["127.0.0.1"])
    files = tls.resolve("~/certs", "127.0.0.1")
    assert files.ca == str(tmp_path / "certs" / "ca.pem"), files
    assert tls.resolve(ca="~/certs/ca.pem", cert="~/certs/127.0.0.1.pem", key="~/certs/127.0.0.1.key").key == \
        str(tmp_path / "certs" / "127.0.0.1.key")
