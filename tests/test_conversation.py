"""The CLI's conversation mode (-cnv): each reply equals LLM.chat on the conversation so far, through the CLI in a
subprocess (messages on stdin) and through minfer.conversation in process."""
import json
import os
import re
import signal
import time

import pytest

from minfer import LLM, SamplingParams
from minfer.conversation import Conversation
from test_cli import MODEL_PATH, assert_clean_stats, assert_one_line_error, needs_model, run, write_tiny_hf

# A role word, the message, an end word; the tiny model's vocabulary is w0 .. w63 (eos w1).
TEMPLATE = ("{% for m in messages %}{{ {'system': 'w7', 'user': 'w5', 'assistant': 'w6'}[m.role] }} {{ m.content }} "
            "w8 {% endfor %}{% if add_generation_prompt %}w6 {% endif %}")
GREEDY = ["--temperature", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = write_tiny_hf(str(tmp_path_factory.mktemp("cnv") / "tiny"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE}, f)
    return folder


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    return LLM(tiny, device="cpu", dtype="float32")


def replies(llm, turns, max_tokens, system=None):
    """The oracle: LLM.chat on the history so far, turn by turn. A turn of None starts over (/clear)."""
    start = [{"role": "system", "content": system}] if system else []
    history, out = list(start), []
    for text in turns:
        if text is None:
            history = list(start)
            continue
        history.append({"role": "user", "content": text})
        (o,) = llm.chat(history, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        history.append({"role": "assistant", "content": o.text})
        out.append(o.text)
    return out


def assert_idle(llm):
    bm = llm.engine.block_manager
    assert not llm.engine.seqs and bm.num_free_pages == bm.num_pages and not any(bm.ref_count)


def test_turns_equal_chat_on_the_history(tiny, tiny_llm):
    """-p is the first message, stdin the rest; /clear starts over; a line ending in a backslash continues; blank
    lines are skipped; the end of stdin ends the conversation (exit 0). Each reply is LLM.chat's on the history."""
    stdin = "w9 w10\n\n/clear\nw11 \\\nw12\nw13"  # the last line has no newline
    rc, out, err = run(tiny, "-cnv", "-sys", "w20", "-p", "w3 w4", "-n", "4", *GREEDY, stdin=stdin)
    assert rc == 0, err
    assert err == ""  # no stats without -v, no banner when stdin is not a terminal
    llm = LLM(tiny, device="cpu", dtype="float32")
    want = replies(llm, ["w3 w4", "w9 w10", None, "w11 \nw12", "w13"], 4, system="w20")
    assert out == "".join(r + "\n" for r in want)
    assert len(set(want)) > 1  # the turns see different histories


def test_verbose_prints_each_replys_stats_and_the_prefix_hits(tiny):
    """-v: a stats line a reply, the second turn's history from the prefix cache, then the load's parts once."""
    rc, out, err = run(tiny, "-cnv", "-p", " ".join(["w3"] * 20), "-n", "3", "-v", "--block-size", "4", *GREEDY,
                       stdin="w9\n/exit\nw10\n")
    assert rc == 0, err
    first, second, split = err.splitlines()
    assert_clean_stats(first + "\n") and assert_clean_stats(second + "\n")
    cached = re.search(r"prefix cache (\d+) tok", second)
    assert "prefix cache" not in first and cached and int(cached[1]) >= 20  # the first turn's 23 tokens: 5 full pages
    assert split.startswith("[minfer] load ") and "read " in split
    assert len(out.splitlines()) == 2  # /exit ended it before w10


def test_a_turn_past_the_context_is_refused_and_the_history_kept(tiny, tiny_llm):
    rc, out, err = run(tiny, "-cnv", "-n", "2", "-c", "40", *GREEDY, stdin="w3 w4\n" + "w9 " * 40 + "\nw13\n")
    assert rc == 0, err
    (line,) = err.splitlines()
    assert line.startswith("[minfer] ") and "context" in line and "/clear starts over" in line
    assert out == "".join(r + "\n" for r in replies(tiny_llm, ["w3 w4", "w13"], 2))


def test_a_reply_cut_by_the_context_says_so(tiny, tiny_llm):
    """Without -n a reply runs as the context allows; cut there, a notice follows it."""
    rc, out, err = run(tiny, "-cnv", "-c", "24", "--ignore-eos", *GREEDY, stdin="w3 w4\n")
    assert rc == 0, err
    prompt = tiny_llm.get_tokenizer().encode_chat([{"role": "user", "content": "w3 w4"}])
    assert len(out.split()) == 24 - len(prompt)
    assert err == "[minfer] the reply reached the context's end; /clear starts over\n"


def test_stopped_reply_keeps_what_was_shown(tiny_llm):
    """Ctrl-C sets stop_requested: the reply ends after the step in flight, its shown text stays in the history,
    its pages are freed and the next turn runs on that history."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    conv = Conversation(tiny_llm, params)
    shown = []

    def write(delta):
        shown.append(delta)
        conv.stop_requested = True

    reply, reason = conv.reply("w3 w4", write)
    assert reason is None and reply == "".join(shown) and 0 < len(reply.split()) < 20
    assert conv.messages == [{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": reply}]
    assert_idle(tiny_llm)
    reply2, reason2 = conv.reply("w9", lambda d: None)
    (want,) = tiny_llm.chat(conv.messages[:2] + [{"role": "user", "content": "w9"}], params, use_tqdm=False)
    assert (reply2, reason2) == (want.text, "length")
    assert_idle(tiny_llm)


@pytest.mark.parametrize("args,needle", [
    (["--no-chat"], "--conversation needs the chat template"),
    (["-p", "w1", "-p", "w2"], "takes one -p or -f"),
    (["-p", "-"], "cannot; give the first with -p TEXT"),
    (["-l", "99999+1"], "--logit-bias: token id 99999 out of range"),
])
def test_errors_before_the_first_message(tiny, args, needle):
    """Bad flags end the program with one line before any message is read (stdin is left unread)."""
    assert_one_line_error(*run(tiny, "-cnv", *args, *GREEDY, stdin="w3\n"), needle)


def test_error_model_without_a_chat_template(tmp_path):
    rc, out, err = run(write_tiny_hf(str(tmp_path / "plain")), "-cnv", *GREEDY, stdin="w3\n")
    assert_one_line_error(rc, out, err, "no chat template; drop --conversation")


@needs_model
def test_default_model_conversation():
    """The default model, two turns: the second sees the first (the capital asked of "it")."""
    rc, out, err = run("-cnv", "-p", "What is the capital of France?", "-n", "16", *GREEDY,
                       stdin="What is its population?\n")
    assert rc == 0, err
    llm = LLM(MODEL_PATH, device="cpu", dtype="float32")
    want = replies(llm, ["What is the capital of France?", "What is its population?"], 16)
    assert out == "".join(r + "\n" for r in want) and "Paris" in want[0]



class Terminal:
    """The parent's side of a pty: expect(needle) reads until the output past the last match holds needle."""

    def __init__(self, fd):
        self.fd, self.seen, self.pos = fd, bytearray(), 0

    def expect(self, needle: bytes, timeout=120.0) -> int:
        """Where the match starts; the next expect searches past it."""
        import select
        deadline = time.monotonic() + timeout
        while (at := self.seen.find(needle, self.pos)) < 0:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no {needle!r} in {bytes(self.seen[self.pos:])!r}"
            try:
                data = os.read(self.fd, 4096)
            except OSError:  # EIO: the child has closed the terminal
                data = b""
            assert data, f"the terminal closed before {needle!r}: {bytes(self.seen[self.pos:])!r}"
            self.seen += data
        self.pos = at + len(needle)
        return at


@needs_model
def test_terminal_ctrl_c_stops_the_reply_not_the_program():
    """On a terminal: the banner and the '> ' prompt; Ctrl-C during a reply ends the reply (a new prompt
    follows), /exit ends the program with status 0."""
    import pty
    from test_cli import ROOT, env
    pid, fd = pty.fork()
    if pid == 0:  # the child: its terminal is the pty, so ^C there is SIGINT
        os.chdir(ROOT)
        os.execve(os.sys.executable, [os.sys.executable, "-m", "minfer.generate", "-cnv", "--ignore-eos", "-n",
                                      "2000", *GREEDY], env())
    term, status = Terminal(fd), None
    try:
        term.expect(b"/exit or Ctrl-D ends")
        term.expect(b"> ")
        os.write(fd, b"Tell me a long story.\r")
        start = term.expect(b"story.\r\n") + len(b"story.\r\n")  # the terminal's echo
        term.expect(b" ")  # the reply has begun
        os.write(fd, b"\x03")
        end = term.expect(b"\n> ")
        assert 0 < end - start < 2000 * 3  # stopped well before its 2000 tokens
        os.write(fd, b"/exit\r")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = code
                break
            time.sleep(0.05)
    finally:
        if status is None:  # failed or hung: no child left behind
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    assert status is not None and os.waitstatus_to_exitcode(status) == 0, bytes(term.seen)


def test_error_endless_line_on_stdin(tiny):
    """A line of stdin is read up to 64 MiB: past that (`yes | tr -d '\\n'`), one line and exit 1."""
    rc, out, err = run(tiny, "-cnv", *GREEDY, stdin=b"w3 " * ((64 << 20) // 3 + 1))
    assert_one_line_error(rc, out, err, "a line of stdin holds over 64 MiB")
