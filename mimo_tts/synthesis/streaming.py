"""What a stream pushes to Stage-1, and when (`--stream`, the library's `stream`, the servers'
streamed requests; the speech worker, `synthesis/worker.py`, runs the decoder).

`FrameCollector` gathers one job's generated groups: the ids for the official extraction, and
its audio frames in pushes that follow a schedule; `push_schedule` is that schedule: the
decoder's look-ahead plus the first groups, then pushes growing up to the stream mode's cap.
"""

from __future__ import annotations

from collections.abc import Iterator

from mimo_tts.synthesis.pieces import Piece


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
