"""Overlapped stages: Stage-1 decodes in a worker thread while Stage-0 generates (`--stream`).

The generating thread pushes each chunk of new code frames to a `DecodeWorker`, which runs a
codec streaming decoder (incremental by default, or the official §7.2 re-decoding scheme) on the
tokenizer device and hands each decoded chunk to a callback (raw PCM on stdout, a list, ...).
Stage-0 steps come from `MiMoTTS.stream_steps`: the native LM, or vLLM with `--engine vllm`
(its audio groups arrive one step late). Each stage runs under its own CPU thread budget
(`runtime.thread_budget`), so on one CPU the two stages share the cores instead of fighting for
them. Timings of both stages are recorded on the returned `Piece` for benchmarks.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

from mimo_tts.runtime.guards import oom_advice, thread_budget
from mimo_tts.synthesis.audio import PAUSE_FRAMES
from mimo_tts.synthesis.pieces import Piece


class DecodeWorker:
    """Runs a streaming decoder on the tokenizer device in a thread; chunks go to the sink.

    `inline`: no thread; each push is decoded at once in the caller's (Stage-0's) thread, so the
    stages take turns with every CPU thread instead of splitting the cores (`thread_budgets`).
    """

    def __init__(self, codec, sink, threads: int | None = None, mode: str = "incremental",
                 inline: bool = False):
        self.codec, self.sink, self.threads, self.mode = codec, sink, threads, mode
        self.queue: queue.Queue = queue.Queue()
        self.chunks: list = []
        self.error: BaseException | None = None
        self.busy_s = 0.0  # decode compute, excluding waits for codes and the sink
        self.first_chunk_at: float | None = None  # perf_counter() of the first decoded audio
        self.decoder = None
        self.thread = None
        if not inline:
            self.thread = threading.Thread(target=self._run, name="mimo-tts-stage1", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            with thread_budget(self.threads):
                self._loop()
        except BaseException as exc:  # re-raised in the generating thread by `push`/`join`
            self.error = exc

    def _loop(self) -> None:
        while True:
            codes, last = self.queue.get()
            if codes is None:
                return
            if self.mode != "official":  # chunk-invariant: decode everything queued at once
                codes, last = self._merge_queued(codes, last)
                if codes is None:
                    return
            self._decode(codes, last)
            if last:
                return

    def _decode(self, codes, last: bool) -> None:
        """One push [K, f] through the stream's decoder; new audio goes to the sink."""
        from mimo_tts.codec import StreamingDecoder

        if self.decoder is None:
            self.decoder = StreamingDecoder(self.codec, mode=self.mode)
        start = time.perf_counter()
        with oom_advice("Stage-1 streaming decode", str(self.codec.device)):
            wave = self.decoder.push(codes, last=last)
            if wave is not None and wave.numel():
                wave = wave.detach().float().cpu()  # [S]
        self.busy_s += time.perf_counter() - start
        if wave is not None and wave.numel():
            self.first_chunk_at = self.first_chunk_at or time.perf_counter()
            self.chunks.append(wave)
            if self.sink is not None:
                self.sink(wave)

    def _merge_queued(self, codes, last: bool):
        """The frames queued while the last decode ran, joined to `codes` (None on abort).

        The incremental decoder's output does not depend on how the stream is cut, so when
        Stage-1 falls behind it catches up in one larger push (less compute per frame), and
        while it keeps up it decodes every small chunk at once (a short tail after Stage-0).
        """
        import torch

        parts = [codes]
        while not last:
            try:
                more, last = self.queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                return None, True
            parts.append(more)
        return (torch.cat(parts, dim=1) if len(parts) > 1 else codes), last

    def push(self, codes, last: bool = False) -> None:
        """Queue new frames [K, f]; a failure of the worker surfaces here, without waiting."""
        if self.error is not None:
            raise self.error
        if self.thread is None:
            with thread_budget(self.threads):
                self._decode(codes, last)
            return
        self.queue.put((codes, last))

    def abort(self) -> None:
        if self.thread is not None:
            self.queue.put((None, True))
            self.thread.join(timeout=30)

    def join(self):
        """Wait for the last chunk; the whole streamed waveform [S] (CPU)."""
        import torch

        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        return torch.cat(self.chunks) if self.chunks else torch.zeros(0)


class FrameCollector:
    """One row's generated groups: the ids for extraction, and its audio frames in pushes.

    `add` takes each StepOutput of the row and returns the codes [K, f] to push to Stage-1 once
    `schedule` groups of audio have gathered; `close` returns the last push (maybe empty).
    Frames run from the first audio group to `<|eostm|>`; a generated `<|sostm|>` restarts them,
    as the official extraction reads audio after it (spec §4.8).
    """

    def __init__(self, tts, schedule: Iterator[int]):
        import torch

        self.tts, self.schedule = tts, schedule
        self.empty_codes = torch.tensor(tts.empty_ids).unsqueeze(0).expand(tts.group_size, -1)
        self.blocks, self.pending, self.sent = [], [], []
        self.size = next(schedule)

    def add(self, step):
        """Record one group; the codes [K, f] due for a Stage-1 push, or None."""
        import torch

        special = self.tts.text.special
        codes = self.empty_codes if step.codes is None else step.codes.long()  # [F, K]
        text = torch.full((1, codes.shape[0]), step.text_token, dtype=torch.long)
        self.blocks.append(torch.cat((text, codes.T), dim=0))  # [1 + K, F]
        if step.text_token == special.sostm:
            self.pending.clear()
        elif step.codes is not None and step.text_token == special.empty:
            self.pending.append(codes[codes[:, 0] != self.tts.empty_ids[0]].T)  # [K, f]
            if len(self.pending) >= self.size:
                self.sent.append(torch.cat(self.pending, dim=1))
                self.pending, self.size = [], next(self.schedule)
                return self.sent[-1]
        return None

    def close(self):
        """The last push: the frames still pending [K, f] (f may be 0)."""
        import torch

        self.sent.append(torch.cat(self.pending, dim=1) if self.pending
                         else self.empty_codes.T[:, :0])
        self.pending = []
        return self.sent[-1]

    def extract(self):
        """The official extraction of everything generated (`lm.extract.Extracted`)."""
        import torch

        from mimo_tts.lm.extract import extract

        return extract(torch.cat(self.blocks, dim=1), self.tts.text, self.tts.empty_ids,
                       self.tts.group_size)

    def piece(self, prompt, seed: int, streamed, log, label: str = "") -> Piece:
        """The row's finished piece, as `--stream` and the server both finish one: text and
        codes by the official extraction; the streamed audio [S] kept only when the pushed
        frames are the extracted codes, else None (decode the codes one-shot) with a note."""
        found = self.extract()
        note = None
        if streamed is not None and self.streamed_differs(found):
            note = "streamed frames differ from the extracted codes; the file is decoded one-shot"
            log(f"note: {label + ': ' if label else ''}{note}")
            streamed = None
        return Piece(prompt, seed, list(found.text_tokens), found.text, found.codes,
                     streamed if found.codes is not None else None, note)

    def streamed_differs(self, found) -> bool:
        """Whether the pushed frames differ from the extracted codes (then decode one-shot)."""
        import torch

        return found.codes is not None and not torch.equal(torch.cat(self.sent, dim=1),
                                                           found.codes)


# Largest push (groups) when stream_max_chunk_groups is None, per stream mode.
# Every official push re-decodes a whole window (up to 250 + 40 frames), so fewer pushes save
# compute. An incremental push costs a pass over the decoder's weights plus its frames: 10
# groups keeps that near one-shot compute (docs/performance.md) while the tail left to decode
# after Stage-0 ends stays short; when Stage-1 falls behind, its worker merges queued pushes.
DEFAULT_MAX_CHUNK = {"official": 30, "incremental": 10}


def chunk_cap(mode: str, first: int, most: int | None) -> int:
    """The push cap the options ask for (`most`), or the mode's default; never below `first`."""
    return max(first, DEFAULT_MAX_CHUNK[mode] if most is None else most)


def chunk_schedule(first: int, most: int | None = None, lead: int = 0) -> Iterator[int]:
    """Groups per Stage-1 push: `lead + first` (the decoder's look-ahead and the first
    audio), then doubling from `first` up to `most` (default: `first`, fixed chunks)."""
    most = first if most is None else max(most, first)
    size = first
    yield lead + first
    while True:
        size = min(2 * size, most)
        yield size


def lead_groups(codec, mode: str, group_size: int) -> int:
    """Whole groups a stream holds back before its first audio (`first_audio_frames`, less
    the group that releases it): 10 at full size and on the tiny presets."""
    from mimo_tts.codec import StreamingDecoder

    frames = StreamingDecoder(codec, mode=mode).first_audio_frames
    return -(-frames // group_size) - 1


def push_schedule(tts, mode: str, first: int, most: int | None = None) -> Iterator[int]:
    """The pushes of one stream of `tts`: its first push is the decoder's look-ahead plus
    `first` groups, so the first audio leaves as soon as the decoder can give any
    (`chunk_schedule` with `lead_groups`); the pushes then grow up to the mode's cap."""
    return chunk_schedule(first, chunk_cap(mode, first, most),
                          lead_groups(tts.codec, mode, tts.group_size))


def stream_piece(tts, prompt, options, seed: int, sink, chunk_groups: int, log,
                 mode: str = "incremental", max_chunk_groups: int | None = None) -> Piece:
    """Generate one prompt while decoding its audio frames as they arrive (spec §7.2 scheme).

    Frames are streamed from the first audio group to `<|eostm|>`. If the official extraction
    (spec §4.8) ends up different, e.g. a `<|sostm|>` generated after audio, the file output
    is re-decoded from the extracted codes and a note is logged. `mode` picks the streaming
    decoder (`official` or `incremental`, see `StreamingDecoder`); pushes follow
    `push_schedule` from `chunk_groups` up to `max_chunk_groups` (None: the mode's default).
    Stage-1 decodes in a worker thread, or between Stage-0 steps where the loader's thread
    budgets say the stages take turns (`interleave`). `Piece.timings` holds `stage0_s`
    (generation, less the decodes run between its steps), `prefill_s`, `stage1_s` (decode
    compute), `stage1_wait_s` (waiting for Stage-1 after generation), `first_audio_s`,
    `lead_groups` (groups held back before the first audio) and `wall_s`.
    """
    start = time.perf_counter()
    inline = bool(getattr(tts, "threads", {}).get("interleave"))
    worker = DecodeWorker(tts.codec, sink, tts.tokenizer_threads, mode, inline=inline)
    lead = lead_groups(tts.codec, mode, tts.group_size)
    frames = FrameCollector(tts, chunk_schedule(chunk_groups,
                                                chunk_cap(mode, chunk_groups, max_chunk_groups),
                                                lead))
    try:
        prefill_s = _generate_streaming(tts, prompt, options, worker, frames)
        generated = time.perf_counter()
        audio = worker.join()
    except BaseException:
        worker.abort()
        raise
    piece = frames.piece(prompt, seed, audio, log)
    if piece.audio is None and piece.codes is not None:  # streamed frames were not the codes
        piece = replace(piece, audio=tts.stage1.decode([piece.codes])[0])
    end = time.perf_counter()
    first = worker.first_chunk_at
    between = worker.busy_s if inline else 0.0  # inline decodes ran inside the generation
    timings = {"stage0_s": generated - start - between, "stage1_s": worker.busy_s,
               "stage1_wait_s": end - generated,
               "first_audio_s": (first - start) if first else end - start, "wall_s": end - start,
               "lead_groups": float(lead)}
    if prefill_s is not None:
        timings["prefill_s"] = prefill_s
    return replace(piece, timings=timings)


def _generate_streaming(tts, prompt, options, worker: DecodeWorker,
                        frames: FrameCollector) -> float | None:
    """Stage-0 for one prompt in this thread, pushing its audio frames to the worker; the
    prefill's seconds (None if the engine does not say)."""
    prefill_s = None
    with tts.stage0_guard():
        for step in tts.stream_steps([prompt.input_ids], options):
            if step.prefill_s is not None:
                prefill_s = step.prefill_s
            codes = frames.add(step)
            if codes is not None:
                worker.push(codes)
    worker.push(frames.close(), last=True)
    return prefill_s


def stream_chunks(tts, prompts: list, o) -> Iterator:
    """The library's streaming: each prompt's decoded chunks [S_i] as they come, with a pause
    between prompts; Stage-0 runs in a background thread, an error is raised here."""
    import torch

    chunks: queue.Queue = queue.Queue()

    def run():
        try:
            for i, prompt in enumerate(prompts):
                if i:
                    chunks.put(torch.zeros(PAUSE_FRAMES * tts.stage1.samples_per_frame))
                tts.stream_piece(prompt, o, o.seed, chunks.put, lambda message: None)
            chunks.put(None)
        except BaseException as exc:  # re-raised in the caller's thread
            chunks.put(exc)

    threading.Thread(target=run, name="mimo-tts-stream", daemon=True).start()
    while (chunk := chunks.get()) is not None:
        if isinstance(chunk, BaseException):
            raise chunk
        yield chunk
