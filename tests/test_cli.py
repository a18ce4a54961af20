"""End to end through the CLI (`python -m minfer.generate`) in a subprocess, from the repo root."""
import json
import os
import subprocess
import sys

import pytest
import torch

from minfer import fetch, loader
from minfer.gguf import open_reader
from minfer.tokenizer import from_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_PATH = os.path.join(loader.cache_dir(), loader.DEFAULT_MODEL_FILE)
needs_model = pytest.mark.skipif(not os.path.exists(MODEL_PATH), reason=f"default model not at {MODEL_PATH}")
# fp32 on the CPU everywhere (also on the GPU runner), so that batch and single runs agree exactly.
ACCEPT = ["-p", "The capital of France is", "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu"]


def env():
    e = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "default"}  # warnings would show, not hide
    e.pop("MINFER_DEBUG", None)
    return e


def run(*args, stdin=None, timeout=240):
    """args and stdin are str, or bytes to pass bytes that are not UTF-8."""
    text = not any(isinstance(a, bytes) for a in (*args, stdin))
    p = subprocess.run([sys.executable, "-m", "minfer.generate", *args], cwd=ROOT, input=stdin, capture_output=True,
                       text=text, timeout=timeout, env=env())
    if not text:
        return p.returncode, p.stdout.decode(), p.stderr.decode()
    return p.returncode, p.stdout, p.stderr


def assert_clean_stats(stderr, decoded=True):
    """stderr holds the stats line and nothing else (no warnings, no progress bars). decoded: there were
    decode steps, so a decode speed."""
    lines = stderr.splitlines()
    assert len(lines) == 1, f"stderr should be the stats line only:\n{stderr}"
    line = lines[0]
    assert line.startswith("[minfer] ")
    for key in ("ttft", "prefill", "decode"):
        assert key in line
    assert line.count("tok/s") == (2 if decoded else 1)
    assert decoded or "decode –" in line
    return line


def assert_one_line_error(rc, stdout, stderr, *needles):
    assert rc != 0
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert lines[0].startswith("minfer: error: ") and "Traceback" not in stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert stdout == ""


@pytest.fixture(scope="module")
def accepted():
    rc, out, err = run(*ACCEPT)
    assert rc == 0, err
    return out, err


@needs_model
def test_acceptance_paris(accepted):
    out, err = accepted
    assert out.startswith(" Paris"), out
    assert out.endswith("\n")
    line = assert_clean_stats(err)
    assert "ref float32 on cpu" in line


@needs_model
def test_stdin_prompt_and_stop_string(accepted):
    """`-p -` reads the prompt from stdin (one trailing newline dropped); --stop cuts the text before the
    stop string. One run covers both, to keep CI time down."""
    full = accepted[0].rstrip("\n")
    assert "." in full
    rc, out, err = run("-p", "-", *ACCEPT[2:], "--stop", ".", stdin="The capital of France is\n")
    assert rc == 0, err
    assert_clean_stats(err)
    assert out == full[: full.index(".")] + "\n"


@needs_model
def test_logit_bias_flag(capsys):
    """-l/--logit-bias in llama.cpp's form: +100 on a token forces it at every step (in process, one short run)."""
    rc, out, err = main(capsys, "-p", "Hi", "--temperature", "0", "-n", "3", "-l", "42+100", "--logit-bias", "3-1.5")
    assert rc == 0, err
    tok = from_gguf(open_reader(MODEL_PATH))
    assert out == tok.decode([42] * 3) + "\n"
    for spec, needle in [("42", "TOKEN_ID"), ("42+101", "[-100, 100]"), ("99999999+1", "out of range")]:
        try:
            rc, out, err = main(capsys, "-p", "hi", "--temperature", "0", "-l", spec)
        except SystemExit as e:
            rc, (out, err) = e.code, capsys.readouterr()
        assert_one_line_error(rc, out, err, "--logit-bias", needle)


@needs_model
def test_batch_of_two_prompts(accepted):
    rc, out, err = run(*ACCEPT, "-p", "Water boils at")
    assert rc == 0, err
    assert_clean_stats(err)
    head0, head1 = "--- [0] 'The capital of France is'\n", "--- [1] 'Water boils at'\n"
    assert out.startswith(head0) and head1 in out
    first, second = out[len(head0):].split(head1)
    # greedy in fp32: the padded batch gives the same text as the single run
    assert first == accepted[0]
    assert second.strip()


@needs_model
def test_chat(accepted):
    rc, out, err = run("--chat", "-p", "What is the capital of France? Answer in one word.", "--temperature", "0",
                       "--max-new-tokens", "12", "--device", "cpu")
    assert rc == 0, err
    assert_clean_stats(err)
    assert out.strip() and "<|im" not in out
    assert "Paris" in out


GEMMA_PATH = os.environ.get("MINFER_GEMMA3_GGUF", os.path.join(loader.cache_dir(), fetch.MODELS["gemma3-270m"].file))


@pytest.mark.skipif(not os.path.exists(GEMMA_PATH), reason=f"gemma-3-270m GGUF not at {GEMMA_PATH} "
                                                         "(bash setup.sh --model gemma3-270m)")
def test_real_gemma3_gguf():
    """The real gemma-3-270m Q4_K_M file through the CLI: its greedy text is the LLM API's, which
    test_gemma3.py holds to transformers' on the same file."""
    from minfer import LLM, SamplingParams
    rc, out, err = run(GEMMA_PATH, *ACCEPT)
    assert rc == 0, err
    assert_clean_stats(err)  # (no notice that its sliding-window layers keep no prefix cache: nobody asked for one)
    llm = LLM(GEMMA_PATH, dtype=torch.float32, device="cpu")
    (expected,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8),
                               use_tqdm=False)
    assert expected.text.strip() and out == expected.text + "\n"


@needs_model
def test_dequantize_gives_the_same_greedy_text(accepted):
    """--dequantize expands the GGUF's blocks at load. On the CPU the ref backend expands them anyway, and a
    kept-quantized weight is dequantized to the same fp32 values before each matmul: the same greedy text."""
    rc, out, err = run(*ACCEPT, "--dequantize")
    assert rc == 0, err
    assert_clean_stats(err)
    assert out == accepted[0]


# ---- errors: non-zero exit, exactly one line on stderr, no traceback ----

def write_tiny_hf(folder, arch="LlamaForCausalLM"):
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    v, h, inter, layers, heads, kv = 64, 32, 48, 2, 4, 2
    hd = h // heads
    cfg = dict(architectures=[arch], model_type="llama", vocab_size=v, hidden_size=h, intermediate_size=inter,
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, rms_norm_eps=1e-5,
               max_position_embeddings=128, eos_token_id=1)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    # Seeded: with eos_token_id 1 among 64 tokens, about one draw in 64 of random weights made the first
    # greedy token the end of sequence, so the run printed nothing and test_tiny_hf_folder_runs failed.
    gen = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen),
         "model.norm.weight": torch.rand(h, generator=gen) + 0.5, "lm_head.weight": torch.randn(v, h, generator=gen)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                  "self_attn.q_proj.weight": (heads * hd, h), "self_attn.k_proj.weight": (kv * hd, h),
                  "self_attn.v_proj.weight": (kv * hd, h), "self_attn.o_proj.weight": (h, heads * hd),
                  "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
        w.update({p + n: torch.randn(s, generator=gen) for n, s in shapes.items()})
    save_file(w, os.path.join(folder, "model.safetensors"))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(v)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    return folder


def test_tiny_hf_folder_runs(tmp_path):
    folder = write_tiny_hf(str(tmp_path / "tiny"))
    rc, out, err = run(folder, "-p", "w3 w4 w5", "--max-new-tokens", "5", "--temperature", "0", "--device", "cpu")
    assert rc == 0, err
    assert_clean_stats(err)
    assert "prompt 3 tok" in err
    words = out.split()
    assert 1 <= len(words) <= 5 and all(w.startswith("w") for w in words)


def test_error_missing_path(tmp_path):
    assert_one_line_error(*run(str(tmp_path / "nope.gguf"), "-p", "hi"), "no such file")


def test_error_named_model_not_installed(tmp_path):
    e = {**env(), "MINFER_CACHE": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "minfer.generate", "gemma3-270m", "-p", "hi"], cwd=ROOT,
                       capture_output=True, text=True, timeout=240, env=e)
    assert_one_line_error(p.returncode, p.stdout, p.stderr, "gemma3-270m is not installed",
                          "python -m minfer.fetch gemma3-270m")


def test_error_folder_without_checkpoint(tmp_path):
    assert_one_line_error(*run(str(tmp_path), "-p", "hi"), str(tmp_path))


def test_error_folder_without_weights(tmp_path):
    folder = write_tiny_hf(str(tmp_path / "tiny"))
    os.remove(os.path.join(folder, "model.safetensors"))
    assert_one_line_error(*run(folder, "-p", "w1"), "model.safetensors")


@pytest.mark.parametrize("keep", [0.5, 20])
def test_error_truncated_safetensors(tmp_path, keep):
    folder = write_tiny_hf(str(tmp_path / "tiny"))
    path = os.path.join(folder, "model.safetensors")
    size = os.path.getsize(path)
    os.truncate(path, int(size * keep) if keep < 1 else keep)  # in the data region, or inside the header
    assert_one_line_error(*run(folder, "-p", "w1"), "model.safetensors")


def test_error_unsupported_architecture(tmp_path):
    folder = write_tiny_hf(str(tmp_path / "gpt2"), arch="GPT2LMHeadModel")
    assert_one_line_error(*run(folder, "-p", "w1"), "GPT2LMHeadModel", "LlamaForCausalLM")


@needs_model
@pytest.mark.parametrize("where", ["header", "tensor_data"])
def test_error_truncated_gguf(tmp_path, where):
    import gguf

    if where == "header":
        cut = 1_000_000
    else:  # halfway into the tensor data
        start = min(t.data_offset for t in gguf.GGUFReader(MODEL_PATH).tensors)
        cut = (start + os.path.getsize(MODEL_PATH)) // 2
        assert cut > start
    path = str(tmp_path / "cut.gguf")
    with open(MODEL_PATH, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(cut))
    assert_one_line_error(*run(path, "-p", "hi"), "cut.gguf")


def test_error_not_a_checkpoint_file(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(os.urandom(4096))
    assert_one_line_error(*run(str(path), "-p", "hi"), "model.bin")


@pytest.mark.parametrize("n", [40, 16])
def test_error_prompt_longer_than_context(tmp_path, n):
    folder = write_tiny_hf(str(tmp_path / "tiny"))  # a tiny model: loading the default one costs CI time
    prompt = " ".join(f"w{i % 60 + 2}" for i in range(n))
    assert_one_line_error(*run(folder, "-p", prompt, "--max-context", "16"), f"{n} tokens", "16", "no room")


def test_error_context_past_the_model(tmp_path):
    """-c past the model's positions is refused (as vLLM does), not capped in silence; a prompt that fills the
    model's whole context says so, not to raise -c."""
    folder = write_tiny_hf(str(tmp_path / "tiny"))  # 128 positions
    assert_one_line_error(*run(folder, "-p", "hi", "-c", "129"), "129", "128 positions")
    prompt = " ".join(f"w{i % 60 + 2}" for i in range(130))
    assert_one_line_error(*run(folder, "-p", prompt), "the model holds 128 positions")


@pytest.mark.parametrize("bad", [["--top-p", "0"], ["--max-new-tokens", "0"], ["--temperature", "-1"]])
def test_error_bad_options(bad):
    assert_one_line_error(*run("-p", "hi", *bad))


# ---- in process: options checked before anything is loaded ----

def main(capsys, *args):
    from minfer import generate
    rc = generate.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


SAMPLING_FLAGS = ["--temperature", "--top-k", "--top-p", "--min-p", "--repetition-penalty", "--presence-penalty",
                  "--frequency-penalty"]


@pytest.mark.parametrize("flag,value", [("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "1e-40"),
                                        ("--top-p", "nan"), ("--top-p", "1.5"), ("--min-p", "nan"), ("--min-p", "1"),
                                        ("--top-k", "-1"),
                                        ("--repetition-penalty", "nan"), ("--repetition-penalty", "inf"),
                                        ("--repetition-penalty", "0"), ("--frequency-penalty", "2.5"),
                                        ("--frequency-penalty", "-2.5"), ("--frequency-penalty", "nan")])
def test_error_names_the_one_bad_sampling_flag(capsys, flag, value):
    rc, out, err = main(capsys, "-p", "hi", "--temperature", "0", flag, value)
    assert_one_line_error(rc, out, err, flag)
    assert [f for f in SAMPLING_FLAGS if f in err] == [flag]


@pytest.mark.parametrize("args,needle", [(["--top-k", "x"], "--top-k"), (["--bogus"], "--bogus"),
                                         (["--dtype", "foo"], "--dtype"), (["-p"], "-p/--prompt"),
                                         (["--frequency-penalty", "-inf"], "--frequency-penalty"),  # a value, not a flag
                                         (["--repetition-penalty", "1e-46"], "--repetition-penalty"),  # 0 in fp32
                                         (["--temperature", "1e39"], "--temperature")])  # inf in fp32
def test_error_bad_flags_are_one_line_and_exit_1(capsys, args, needle):
    """argparse's own errors (a bad value's type, an unknown flag, a missing value) follow the CLI's rule too:
    one line, exit 1, no usage block."""
    try:
        rc, out, err = main(capsys, "-p", "hi", "--temperature", "0", *args)
    except SystemExit as e:
        rc, (out, err) = e.code, capsys.readouterr()
    assert rc == 1
    assert_one_line_error(rc, out, err, needle)


@pytest.mark.parametrize("flag", [[], ["--dequantize"]])
def test_dequantize_flag_reaches_the_engine(capsys, monkeypatch, flag):
    """On the CPU --dequantize changes no output (see test_dequantize_gives_the_same_greedy_text), so check that
    it gets to LLM(dequantize=...) at all; LLM is stopped there, before loading anything."""
    from minfer import llm
    from minfer.errors import MinferError
    seen = {}

    def spy(self, model=None, **kw):
        seen.update(kw)
        raise MinferError("stopped by the test")

    monkeypatch.setattr(llm.LLM, "__init__", spy)
    assert_one_line_error(*main(capsys, "-p", "hi", "--temperature", "0", *flag), "stopped by the test")
    assert seen["dequantize"] is bool(flag)


def test_good_small_temperature_is_accepted():
    from minfer.sampling import MIN_TEMPERATURE, SamplingParams
    SamplingParams(temperature=MIN_TEMPERATURE)
    SamplingParams(temperature=0)


def test_error_empty_stop_string(capsys):
    assert_one_line_error(*main(capsys, "-p", "hi", "--stop", ""), "--stop", "empty")


def test_error_system_with_no_chat_names_both(capsys):
    assert_one_line_error(*main(capsys, "-p", "hi", "--system", "Be brief.", "--no-chat"), "--system", "--no-chat")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
@pytest.mark.parametrize("args,needle", [(["--backend", "cuda"], "--backend cuda"), (["--device", "cuda"], "--device cuda"),
                                         (["--device", "foo"], "--device 'foo'"), (["--device", "mps"], "--device mps")])
def test_error_no_gpu_or_bad_device_is_a_user_error(capsys, args, needle):
    rc, out, err = main(capsys, "-p", "hi", *args)
    assert_one_line_error(rc, out, err, needle)
    assert "Error:" not in err and "MINFER_DEBUG" not in err  # a MinferError, not an internal one


def test_help_shows_defaults(capsys):
    from minfer import generate
    with pytest.raises(SystemExit):
        generate.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 'Hello')" in out
    for default in ("(default: 256)", "(default: 0.7)", "(default: auto", "(default: 1.0)"):
        assert default in out


def test_common_flag_names():
    """The names vLLM and llama.cpp use work too."""
    from minfer import generate
    a = generate.parse_args(["-m", "x.gguf", "--temp", "0", "-n", "3", "-c", "64", "--repeat-penalty", "1.1",
                             "--system-prompt", "s", "-s", "5"])
    assert (a.checkpoint, a.temperature, a.max_new_tokens, a.max_context, a.repetition_penalty, a.system, a.seed) == \
        ("x.gguf", 0.0, 3, 64, 1.1, "s", 5)
    b = generate.parse_args(["--max-tokens", "7", "--max-model-len", "99", "--ctx-size", "98", "-sys", "t", "-cnv"])
    assert (b.max_new_tokens, b.max_context, b.system, b.conversation) == (7, 98, "t", True)


# ---- the tiny model, in a subprocess, on the CPU (its head_dim 8 has no CUDA kernel) ----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_hf(str(tmp_path_factory.mktemp("cli") / "tiny"))


@pytest.mark.parametrize("flag", ["--chat", "--system"])
def test_error_no_chat_template_names_the_flag_given(tiny, flag):
    args = ["--chat"] if flag == "--chat" else ["--system", "Be brief."]
    rc, out, err = run(tiny, "-p", "w1", *args)
    assert_one_line_error(rc, out, err, f"drop {flag}")
    assert ("--chat" in err) == (flag == "--chat")


def test_non_utf8_stdin_and_argv(tiny):
    rc, out, err = run(tiny, "-p", "-", "-n", "3", "--temperature", "0", "--device", "cpu", stdin=b"w3 Caf\xe9 w4\n")
    assert rc == 0, err
    notice, stats = err.splitlines()
    assert "stdin is not valid UTF-8" in notice and "U+FFFD" in notice
    assert_clean_stats(stats + "\n")
    rc, out, err = run(tiny, "-p", b"w3 Caf\xe9", "-n", "3", "--temperature", "0", "--device", "cpu")
    assert rc == 0, err
    assert "-p is not valid UTF-8" in err.splitlines()[0]


def test_prompt_files(tiny, tmp_path):
    """-f FILE is a prompt as -p gives it (one trailing newline dropped, as llama.cpp drops it), in order with -p; a
    missing file is a one-line error naming it; undecodable bytes are replaced, with a notice."""
    (tmp_path / "a.txt").write_text("w3 w4\n")
    (tmp_path / "b.txt").write_bytes(b"w1 Caf\xe9")
    greedy = ["-n", "3", "--temperature", "0", "--device", "cpu"]
    assert run(tiny, "-f", str(tmp_path / "a.txt"), *greedy)[:2] == run(tiny, "-p", "w3 w4", *greedy)[:2]
    rc, out, err = run(tiny, "-p", "w2", "-f", str(tmp_path / "a.txt"), "-f", str(tmp_path / "b.txt"), *greedy)
    assert rc == 0, err
    assert [line for line in out.splitlines() if line.startswith("---")] == \
        ["--- [0] 'w2'", "--- [1] 'w3 w4'", "--- [2] 'w1 Caf\ufffd'"]
    assert f"-f {tmp_path / 'b.txt'} is not valid UTF-8" in err
    rc, out, err = run(tiny, "-f", str(tmp_path / "missing.txt"), *greedy)
    assert_one_line_error(rc, out, err, "missing.txt")


def test_non_utf8_prompt_is_checked_before_loading(tmp_path):
    rc, out, err = run(str(tmp_path / "missing"), "-p", b"Caf\xe9")
    lines = err.splitlines()
    assert rc == 1 and "-p is not valid UTF-8" in lines[0] and "no such file" in lines[1]


def test_closed_stdout_exits_quietly(tiny):
    """As `... | head -c 20`: the reader goes away; no error message, exit status 141 (as for SIGPIPE)."""
    p = subprocess.Popen([sys.executable, "-m", "minfer.generate", tiny, "-p", "w1", "-n", "50", "--ignore-eos",
                          "--device", "cpu"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env())
    p.stdout.close()  # before the first token is written: the write fails with EPIPE
    err = p.stderr.read().decode()
    assert p.wait(timeout=240) == 141, err
    assert err == ""


def test_stop_on_first_token_reports_no_decode_speed(tiny):
    rc, out, err = run(tiny, "-p", "w1 w2", "--stop", "w", "-n", "8", "--device", "cpu")
    assert rc == 0, err
    assert out == "\n"
    assert_clean_stats(err, decoded=False)


def test_ignore_eos_and_verbose(tiny):
    rc, out, err = run(tiny, "-p", "w1 w2", "-n", "9", "--ignore-eos", "--temperature", "1.5", "--seed", "3", "-v",
                        "--device", "cpu")
    assert rc == 0, err
    assert len(out.split()) == 9
    stats, split = err.splitlines()  # no GPU memory line on the CPU
    assert_clean_stats(stats)
    for part in ("read", "upload", "dequantize"):
        assert f"{part} " in split


def test_error_stdin_past_any_context():
    """`-p -` reads at most 64 MiB: an endless stdin (`yes | ...`) is a one-line error, not a full memory."""
    rc, out, err = run("-p", "-", stdin=b"x" * ((64 << 20) + 1))
    assert_one_line_error(rc, out, err, "stdin holds over 64 MiB")


def test_error_text_no_context_holds(tiny):
    """A text longer than any tokenization of the context is refused before it is tokenized."""
    rc, out, err = run(tiny, "-p", "-", "--device", "cpu", stdin="w3 " * 200_000)
    assert_one_line_error(rc, out, err, "600000 characters, more than 128 tokens")


@pytest.mark.parametrize("flag", [[""], ["-m", ""]])
def test_error_empty_checkpoint(flag):
    assert_one_line_error(*run(*flag, "-p", "hi"), "empty name")


def test_error_page_past_the_context(tiny):
    assert_one_line_error(*run(tiny, "-p", "hi", "--device", "cpu", "--block-size", "256"),
                          "--block-size 256 is past the 128-token context")


def test_chat_template_flag(tiny, tmp_path):
    """--chat-template (vLLM's and llama.cpp's flag): a file or the template itself, in place of the model's (the tiny
    model has none); the text equals LLM.chat's with that template. A missing file, broken Jinja or bytes that are
    not UTF-8 are one line naming the flag, before the model loads."""
    from minfer import LLM, SamplingParams
    template = "{% for m in messages %}w5 {{ m.content }} w8 {% endfor %}w6 "
    (tmp_path / "t.jinja").write_text(template)
    (want,) = LLM(tiny, device="cpu", dtype="float32").chat([{"role": "user", "content": "w3 w4"}],
                                                             SamplingParams(temperature=0, max_tokens=4),
                                                             use_tqdm=False, chat_template=template)
    for spec, chat in ((str(tmp_path / "t.jinja"), ["--chat"]), (template, [])):  # --chat-template implies --chat
        rc, out, err = run(tiny, *chat, "-p", "w3 w4", "-n", "4", "--temperature", "0", "--device", "cpu",
                           "--chat-template", spec)
        assert rc == 0, err
        assert out == want.text + "\n"
    (again,) = LLM(tiny, device="cpu", dtype="float32").chat(
        [{"role": "user", "content": "w3 w4"}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
        chat_template=str(tmp_path / "t.jinja"))  # LLM.chat reads a file's path as --chat-template does
    assert again.token_ids == want.token_ids
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    (tmp_path / "bytes.jinja").write_bytes(b"{{ caf\xe9 }}")
    for spec, needle in [(str(tmp_path / "none.jinja"), "no such file"), (str(tmp_path / "bad.jinja"), "not valid Jinja"),
                         ("{{ x", "not valid Jinja"), (str(tmp_path / "bytes.jinja"), "not UTF-8")]:
        rc, out, err = run(str(tmp_path / "no-model"), "--chat", "-p", "w3", "--chat-template", spec)
        assert_one_line_error(rc, out, err, "--chat-template", needle)
    # a template that fails on the messages it is given: one line too
    rc, out, err = run(tiny, "--chat", "-p", "w3", "--device", "cpu", "--chat-template", "{{ messages[5].content.x }}")
    assert_one_line_error(rc, out, err, "chat template: UndefinedError")


@needs_model
def test_json_schema_and_grammar_flags(capsys, tmp_path):
    """llama.cpp's -j/--json-schema, -jf/--json-schema-file, --grammar and --grammar-file constrain the output; a bad
    schema or grammar is one line naming the flag, before any token."""
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}}, "required": ["capital"],
              "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.gbnf").write_text('root ::= ("yes" | "no") "."')
    greedy = ["-p", "France's capital, as JSON:", "--temperature", "0", "-n", "24", "--device", "cpu"]
    for flag in (["-j", json.dumps(schema)], ["-jf", str(tmp_path / "s.json")]):
        rc, out, err = main(capsys, *greedy, *flag)
        assert rc == 0, err
        assert set(json.loads(out)) == {"capital"}
    from minfer.generate import _constraint, parse_args
    from minfer.structured import StructuredOutputs
    assert _constraint(parse_args(["-j", "{}"])) == (StructuredOutputs(json_object=True), "--json-schema")  # llama.cpp's
    rc, out, err = main(capsys, *greedy, "--grammar-file", str(tmp_path / "g.gbnf"))
    assert rc == 0 and out in ("yes.\n", "no.\n")
    for args, needle in [(["-j", "{bad"], "--json-schema: not JSON"), (["-j", '{"type": "strong"}'], "--json-schema: "),
                         (["-j", "0"], "a JSON schema is an object"), (["-j", "false"], "matches nothing"),
                         (["-j", '"{}"'], "a JSON schema is an object"),
                         (["--grammar", "root ::= nothing"], "--grammar: "),
                         (["--grammar-file", str(tmp_path / "none.gbnf")], "none.gbnf"),
                         (["-j", "{}", "--grammar", 'root ::= "a"'], "not allowed with")]:
        try:
            rc, out, err = main(capsys, *greedy, *args)
        except SystemExit as e:  # argparse's own errors
            rc, (out, err) = e.code, capsys.readouterr()
        assert_one_line_error(rc, out, err, needle)


@pytest.mark.parametrize("cli", ["generate", "serve"])
def test_checkpoint_as_argument_or_model_flag(cli, capsys):
    """CHECKPOINT and -m / --model / -hf are one argument in both CLIs (engine_args.add_checkpoint_args): either gives
    the checkpoint, none the default model, both at once a one-line error; serve's --shape excludes -m too."""
    import importlib
    parse_args = importlib.import_module("minfer.generate" if cli == "generate" else "minfer.serve.__main__").parse_args
    assert parse_args(["a.gguf"]).checkpoint == "a.gguf"
    for flag in ("-m", "--model", "-hf"):
        assert parse_args([flag, "b.gguf"]).checkpoint == "b.gguf"
    assert parse_args([]).checkpoint is None
    assert parse_args(["-m", ""]).checkpoint == ""  # kept, for the loader's "empty name" error
    bad = [(["a.gguf", "-m", "b.gguf"], "give the checkpoint once")]
    if cli == "serve":
        bad.append((["-m", "b.gguf", "--shape", "llama-3-8b"], "give a CHECKPOINT or --shape, not both"))
    for argv, needle in bad:
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 1 and needle in err and len(err.splitlines()) == 1, (argv, err)
