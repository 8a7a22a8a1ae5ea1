"""The server's `engine.RequestQueue`: admission, batching by options, limits.

The batching strategy's source, checked without HTTP or a model: jobs carry plain option
values, since the queue only compares them.
"""

from __future__ import annotations

from mimo_tts.server.engine import RequestQueue, SpeechJob, Ticket


def jobs_of(ticket: Ticket, *options) -> list[SpeechJob]:
    return [SpeechJob(prompt=None, options=o, seed=0, stream=True,
                      deliver=lambda event: None, ticket=ticket) for o in options]


def test_admission_stops_at_the_queue_bound():
    queue = RequestQueue(max_queued=2, max_active=8)
    first, second, third = Ticket(), Ticket(), Ticket()
    assert queue.admit(first) and queue.admit(second) and not queue.admit(third)
    queue.put(jobs_of(first, "a"))
    assert queue.take(8) and queue.counts() == {"active": 1, "queued": 1}
    assert queue.admit(third)  # the started request no longer counts as waiting


def test_a_batch_shares_the_first_jobs_options_in_queue_order():
    queue = RequestQueue(max_queued=8, max_active=8)
    tickets = [Ticket() for _ in range(4)]
    for ticket, option in zip(tickets, ("a", "b", "a", "a"), strict=True):
        assert queue.admit(ticket)
        queue.put(jobs_of(ticket, option))
    batch = queue.take(2)
    assert [j.ticket for j in batch] == [tickets[0], tickets[2]]
    assert [j.ticket for j in queue.take(8)] == [tickets[1]]
    assert [j.ticket for j in queue.take(8)] == [tickets[3]]
    assert queue.take(8, block=False) == []


def test_no_new_request_starts_past_max_active_but_its_own_pieces_do():
    queue = RequestQueue(max_queued=8, max_active=1)
    busy, waiting = Ticket(), Ticket()
    for ticket in (busy, waiting):
        queue.admit(ticket)
    queue.put(jobs_of(busy, "a"))
    queue.put(jobs_of(waiting, "a"))
    queue.put(jobs_of(busy, "a"))  # a later text piece of the active request
    assert [j.ticket for j in queue.take(8)] == [busy, busy]
    assert queue.take(8, block=False) == []
    queue.release(busy)
    assert [j.ticket for j in queue.take(8)] == [waiting]


def test_release_drops_a_requests_waiting_jobs_and_close_ends_take():
    queue = RequestQueue(max_queued=8, max_active=8)
    gone = Ticket()
    queue.admit(gone)
    queue.put(jobs_of(gone, "a", "a"))
    queue.release(gone)
    assert queue.take(8, block=False) == [] and queue.counts() == {"active": 0, "queued": 0}
    queue.close()
    assert queue.take(8) is None and not queue.admit(Ticket())
