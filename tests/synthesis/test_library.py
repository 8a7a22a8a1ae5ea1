"""The library face (`mimo_tts.load` -> `MiMoTTS`): the README's example runs as written, and
the library path gives the CLI's bytes for the same inputs."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from mimo_tts.presets import ensure_tiny_preset
from mimo_tts.runtime.paths import CACHE_ENV
from mimo_tts.synthesis.audio import encode_audio

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_example() -> str:
    section = README.read_text(encoding="utf-8").split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def tiny_env(tiny_cache, monkeypatch):
    monkeypatch.setenv("MIMO_TTS_CACHE", str(tiny_cache))
    for name in ("MIMO_AUDIO_TOKENIZER_DEVICE", "MIMO_AUDIO_TOKENIZER_PATH",
                 "MIMO_TTS_LM_DEVICE", "MIMO_AUDIO_TOKENIZER_CUDA_GRAPH"):
        monkeypatch.delenv(name, raising=False)


def test_readme_example_returns_numpy_audio_at_24_khz(tiny_env, capsys):
    code = _readme_example()
    assert len(code.strip().splitlines()) <= 5 and "mimo_tts.load(" in code
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 (the documented example)
    audio = scope["audio"]
    assert isinstance(audio.samples, np.ndarray) and audio.samples.dtype == np.float32
    assert audio.sample_rate == 24000 and audio.samples.ndim == 1
    assert audio.samples.size % 960 == 0 and np.isfinite(audio.samples).all()
    assert audio.provenance["model"]["name"] == "tiny" and audio.provenance["seed"] == 0
    assert capsys.readouterr().out.startswith("float32 24000 ")


@pytest.fixture(scope="module")
def tts(tiny_cache):
    import mimo_tts

    lm, tok = ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})
    return mimo_tts.load(str(lm), str(tok), lm_device="cpu", tokenizer_device="cpu")


def test_library_audio_equals_the_cli_file_byte_for_byte(tts, invoke, tmp_path):
    """Same text, seed and split: the CLI's wav bytes are the library's samples, encoded."""
    from mimo_tts.batch import files as mio

    text = "A first sentence here. And a second one to split."
    result = invoke("synth", "--model", str(tts.lm_ref.path), "--tokenizer",
                    str(tts.tok_ref.path), "--lm-device", "cpu", "--tokenizer-device", "cpu",
                    "--text", text, "--seed", "4", "--max-chars", "25", "-o", "cli.wav",
                    "--save-codes")
    assert result.exit_code == 0, result.stderr
    audio = tts.synthesize(text, seed=4, max_chars=25)
    assert len(audio.provenance["pieces"]) > 1  # split on sentence ends
    assert (tmp_path / "cli.wav").read_bytes() == encode_audio(audio.samples, 24000, "wav")
    pieces, _ = mio.load_codes(tmp_path / "cli.codes.safetensors")
    assert tts.decode(pieces).samples.tobytes() == audio.samples.tobytes()


def test_stream_chunks_join_to_the_streamed_audio(tts):
    chunks = list(tts.stream("Streaming from the library.", seed=1, max_new_groups=12))
    assert [c.index for c in chunks] == list(range(len(chunks))) and len(chunks) >= 1
    joined = np.concatenate([c.samples for c in chunks])
    assert joined.dtype == np.float32 and joined.size == 960 * 4 * 12
    one_shot = tts.synthesize("Streaming from the library.", seed=1, max_new_groups=12)
    assert joined.shape == one_shot.samples.shape
    assert np.abs(joined - one_shot.samples).max() < 0.03 * np.abs(one_shot.samples).max()


def test_batch_form_equals_single_calls(tts):
    from mimo_tts import SynthesisOptions

    texts = ["One.", "Two, a bit longer."]
    batched = tts.synthesize_batch(texts, batch_size=2, seed=2, temperature=0.0,
                                   audio_temperature=0.0, max_new_groups=6)
    greedy = SynthesisOptions(temperature=0.0, audio_temperature=0.0, max_new_groups=6)
    single = [tts.synthesize(t, seed=2, options=greedy) for t in texts]
    assert [a.provenance["pieces"][0]["generated_text_ids"] for a in batched] == [
        a.provenance["pieces"][0]["generated_text_ids"] for a in single]


def test_load_refuses_what_cannot_fit_with_the_clis_message(tiny_env, mimo, monkeypatch):
    """The library loads through the one loader: the memory preflight refuses before loading,
    with the exported typed error and the same message the CLI prints (exit 4)."""
    import mimo_tts
    from mimo_tts.runtime.machine import AVAILABLE_ENV

    monkeypatch.setenv(AVAILABLE_ENV, "200MiB")
    with pytest.raises(mimo_tts.NotEnoughMemoryError) as refused:
        mimo_tts.load("tiny", lm_device="cpu", tokenizer_device="cpu")
    assert isinstance(refused.value, mimo_tts.DeviceError) and refused.value.exit_code == 4
    cli = mimo("synth", "--model", "tiny", "--lm-device", "cpu", "--tokenizer-device", "cpu",
               "--text", "Hi.", env={AVAILABLE_ENV: "200MiB"})
    assert cli.returncode == 4
    assert cli.stderr.decode().strip() == f"Error: {refused.value}"


def test_load_without_a_model_names_the_clis_default(tiny_env, tmp_path, monkeypatch):
    """No silent random preset: a bare load() asks for the published 7B LM (here: not in the
    empty Hugging Face cache, so the checkpoint error names it and the fetch command)."""
    import mimo_tts
    from mimo_tts.runtime.checkpoints import DEFAULT_MODEL

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(mimo_tts.CheckpointError, match=re.escape(DEFAULT_MODEL)):
        mimo_tts.load(lm_device="cpu", tokenizer_device="cpu")


def test_load_refuses_a_misspelled_keyword():
    import mimo_tts

    with pytest.raises(TypeError, match="lm_thread"):
        mimo_tts.load("tiny", lm_thread=2)


# --- issue 9: the library runs the CLI's checks -------------------------------------------------


def test_control_characters_are_refused_as_on_the_cli(tts):
    """`clean_text`, as the CLI's items: exit 9 naming the code point (it was synthesised)."""
    import mimo_tts

    with pytest.raises(mimo_tts.InputError, match="text: .*U\\+0007 at 1") as refused:
        tts.synthesize("a\x07b")
    assert refused.value.exit_code == 9
    with pytest.raises(mimo_tts.InputError, match="texts\\[1\\]: .*U\\+001B"):
        tts.synthesize_batch(["fine.", "esc\x1b[31m"])
    with pytest.raises(mimo_tts.InputError, match="empty text"):
        list(tts.stream("   "))


def test_a_str_for_texts_is_a_type_error_naming_texts(tts):
    """`synthesize_batch("abc")` made three items, one per character."""
    for texts in ("abc", b"abc", 5):
        with pytest.raises(TypeError, match="^texts must be a list of strings"):
            tts.synthesize_batch(texts)
    with pytest.raises(TypeError, match="^texts\\[0\\] must be a string"):
        tts.synthesize_batch([3])
    assert tts.synthesize_batch([]) == []


def test_decode_checks_codes_as_the_clis_decode(tts):
    """The codebook count and the code ranges, as `mimo-tts decode` checks a codes file
    (`batch.files.load_codes`, then the codec): 7 codebooks were decoded."""
    import torch

    import mimo_tts

    good = torch.zeros(8, 4, dtype=torch.long)
    cases = [(torch.zeros(7, 4, dtype=torch.long), mimo_tts.InputError, "shape \\[7, 4\\]"),
             (torch.zeros(8, 0, dtype=torch.long), mimo_tts.InputError, "shape \\[8, 0\\]"),
             (torch.zeros(8, 4), mimo_tts.InputError, "float32 values"),
             ([good, torch.zeros(9, 4, dtype=torch.int32)], mimo_tts.InputError, "codes\\[1\\]"),
             (torch.full((8, 4), 10**6), mimo_tts.AudioCheckError, "out of range"),
             ([], mimo_tts.InputError, "no code"), ("codes", TypeError, "^codes must be")]
    for codes, error, match in cases:
        with pytest.raises(error, match=match):
            tts.decode(codes)
    with pytest.raises(TypeError, match="^pause_frames"):
        tts.decode(good, pause_frames=1.5)
    with pytest.raises(mimo_tts.UsageError, match="pause_frames must be in \\[0, 250\\]"):
        tts.decode(good, pause_frames=-1)
    assert tts.decode(good.numpy()).samples.size == 4 * 960  # numpy integers are codes too


@pytest.mark.parametrize("call", ["synthesize", "stream", "synthesize_batch"])
def test_a_misspelled_keyword_is_a_type_error_naming_it(tts, call):
    """Every name that is no SynthesisOptions field, as `load()` refuses its own."""
    text = ["Hi."] if call == "synthesize_batch" else "Hi."
    for value in (0.5, None):  # None was dropped unread: a misspelling went unnoticed
        with pytest.raises(TypeError, match=f"{call}\\(\\).*'temprature'"):
            result = getattr(tts, call)(text, temprature=value)
            list(result) if call == "stream" else None
    with pytest.raises(TypeError, match="^options must be a SynthesisOptions"):
        result = getattr(tts, call)(text, options={"seed": 1})
        list(result) if call == "stream" else None


def test_wrong_types_in_calls_name_the_parameter(tts):
    """Issue 12: a typed error naming the parameter, never torch's or Python's internals."""
    import mimo_tts

    cases = [({"seed": "1"}, "^seed must be an integer"),
             ({"temperature": "hot"}, "^temperature must be a real number"),
             ({"max_chars": None, "max_new_groups": True}, "^max_new_groups"),
             ({"prompt_audio": 5}, "^prompt_audio must be")]
    for given, match in cases:
        with pytest.raises(mimo_tts.OptionTypeError, match=match):
            tts.synthesize("Hi.", **given)
    with pytest.raises(TypeError, match="^text must be a string"):
        tts.synthesize(b"Hi.")
    for size, error in ((0, mimo_tts.UsageError), (True, TypeError), ("3", TypeError)):
        with pytest.raises(error, match="batch.size"):  # `range() arg 3 must not be zero`
            tts.synthesize_batch(["Hi."], batch_size=size)


# --- a batch gives each text its single run's audio ------------------------------------------


def test_batch_of_3_equals_batch_of_1_byte_for_byte(tts):
    """Each text's audio is its own run's at any batch_size (continuous batch: a generator per
    job), as the CLI's --batch-size; before, the rows shared one seed stream (0 of 3 equal)."""
    texts = ["One.", "Two, a bit longer.", "And the third text."]
    one = tts.synthesize_batch(texts, batch_size=1, seed=3, max_new_groups=6)
    three = tts.synthesize_batch(texts, batch_size=3, seed=3, max_new_groups=6)
    assert [a.samples.tobytes() for a in three] == [a.samples.tobytes() for a in one]
    alone = tts.synthesize(texts[2], seed=3, max_new_groups=6)
    assert alone.samples.tobytes() == three[2].samples.tobytes()


# --- the task from the inputs, prompt audio in memory ------------------------------------------


def test_the_task_follows_the_inputs_and_a_missing_one_names_the_flag(tts):
    """No task named: `instruct` alone styles, `prompt_audio` clones (below), as on the
    CLI without --task; a named task that takes no such input is still refused."""
    import mimo_tts

    styled = tts.synthesize("Calm.", instruct="calmly", seed=0, max_new_groups=4)
    assert styled.provenance["task"] == "tts_sft_with_instruct"
    with pytest.raises(mimo_tts.UsageError, match="takes no voice prompt"):  # never read
        tts.synthesize("Hi.", task="tts_sft", prompt_audio="voice.wav")
    with pytest.raises(mimo_tts.InputError, match="needs a voice prompt: give --prompt-audio"):
        tts.synthesize("Hi.", task="tts_sft_with_audio")
    with pytest.raises(mimo_tts.InputError, match="needs a style instruction: give --instruct"):
        tts.synthesize("Hi.", task="tts_sft_with_instruct")


def _voice(rate: int = 16000) -> np.ndarray:
    return (0.3 * np.sin(np.arange(rate // 2) * 2 * np.pi * 220 / rate)).astype(np.float32)


def test_prompt_audio_in_memory_clones_as_its_file_does(tts, tmp_path):
    """`prompt_audio=(samples, rate)` (numpy or torch, [S] or [C, S]) is the file's voice;
    without a task it selects the clone task, as --prompt-audio does on the CLI."""
    import soundfile as sf
    import torch

    wave = _voice()
    sf.write(tmp_path / "voice.wav", wave, 16000, subtype="FLOAT")
    kwargs = {"seed": 1, "max_new_groups": 6}
    from_file = tts.synthesize("Clone me.", prompt_audio=str(tmp_path / "voice.wav"), **kwargs)
    in_memory = tts.synthesize("Clone me.", prompt_audio=(wave, 16000), **kwargs)
    stereo = tts.synthesize("Clone me.", prompt_audio=(torch.tensor(np.stack([wave, wave])),
                                                       16000), **kwargs)
    assert in_memory.provenance["task"] == "tts_sft_with_audio"
    assert in_memory.provenance["prompt_audio"] == {"samples": [8000], "sample_rate": 16000}
    assert in_memory.samples.tobytes() == from_file.samples.tobytes()
    assert stereo.samples.tobytes() == from_file.samples.tobytes()


def test_unusable_prompt_audio_in_memory_is_refused_before_any_work(tts):
    import mimo_tts

    wave = _voice()
    cases = [((wave, 16000.0), TypeError, "sample rate must be an integer"),
             (([0.1] * 800, 16000), TypeError, "numpy array or a torch tensor"),
             ((wave.astype(np.int16), 16000), mimo_tts.InputError, "floating point"),
             ((wave[:0], 16000), mimo_tts.InputError, "at least one sample"),
             ((np.stack([wave, wave]).T, 16000), mimo_tts.InputError, "channels first"),
             ((np.full(800, np.nan, np.float32), 16000), mimo_tts.InputError, "NaN"),
             ((wave, 100), mimo_tts.InputError, "sample rate must be in")]
    for prompt, error, match in cases:
        with pytest.raises(error, match=match):
            tts.synthesize("Clone me.", prompt_audio=prompt)
    with pytest.raises(mimo_tts.InputError, match="40 ms"):  # the codec's own minimum
        tts.synthesize("Clone me.", prompt_audio=(wave[:100], 16000))
