"""Process groups for context-parallel attention: what carries the shards from rank to rank.

A group has ``rank``, ``size`` and ``exchange(arrays)``: send a tuple of arrays to
rank ``rank + 1`` and return the tuple of the same shapes and dtypes that rank
``rank - 1`` sent. A group may also have:

- ``start_exchange(arrays)``, which returns at once with a handle whose ``wait()``
  gives that tuple: the ring then computes while the arrays travel
  (:func:`start_exchange` gives every group that form);
- ``start_send_recv(arrays, to, source)``, the same with any two ranks (send to rank
  ``to``, receive from rank ``source``): what :func:`subgroup` needs to run a ring
  over some of the ranks;
- ``all_to_all(chunks)``: ``chunks[j]`` (a tuple of arrays) to rank ``j``, returning
  the list of what each rank sent here, in one collective (:func:`all_to_all`
  passes the chunks around the ring for a group without it), and
  ``start_all_to_all(chunks)``, the same returning at once with a handle whose
  ``wait()`` gives that list (:func:`start_all_to_all`).

:class:`ThreadGroup` and :class:`NcclGroup` have them all, and so have their
sub-groups.
"""

import collections
import os
import sys
import threading

from ..errors import InvalidArgumentError

HIGHEST_PRIORITY = -(1 << 16)  # a stream priority below any device's greatest


class Received:
    """An exchange that has completed: ``wait()`` returns its arrays."""

    def __init__(self, arrays):
        self._arrays = tuple(arrays)

    def wait(self):
        return self._arrays


def start_exchange(group, arrays):
    """``group.start_exchange(arrays)`` where the group has it, else the blocking
    ``group.exchange`` wrapped as a completed handle."""
    start = getattr(group, "start_exchange", None)
    return start(arrays) if start is not None else Received(group.exchange(arrays))


def all_to_all(group, chunks):
    """``chunks[j]`` (a tuple of arrays) goes to rank ``j``; returns ``received`` with
    ``received[j]`` the tuple rank ``j`` sent here. The group's own ``all_to_all``
    where it has one, else ``size - 1`` ring exchanges that pass every rank's chunks
    along (``size / 2`` times an all-to-all's bytes on average)."""
    native = getattr(group, "all_to_all", None)
    if native is not None:
        return list(native(chunks))
    rank, size = group.rank, group.size
    received = [None] * size
    received[rank] = tuple(chunks[rank])
    held = tuple(a for chunk in chunks for a in chunk)
    width = len(chunks[rank])
    for step in range(1, size):
        held = start_exchange(group, held).wait()  # rank (rank - step)'s chunks
        received[(rank - step) % size] = held[rank * width : (rank + 1) * width]
    return received


def start_all_to_all(group, chunks):
    """:func:`all_to_all` returning at once a handle whose ``wait()`` gives its list:
    the group's own ``start_all_to_all`` where it has one (the exchange then runs under
    the kernels queued before the wait), else the blocking all-to-all, completed."""
    start = getattr(group, "start_all_to_all", None)
    return start(chunks) if start is not None else Received(all_to_all(group, chunks))


class Alone:
    """The group of one rank: every exchange hands back what it is given."""

    rank, size = 0, 1

    def exchange(self, arrays):
        return tuple(arrays)

    def all_to_all(self, chunks):
        return [tuple(chunks[0])]

    def start_all_to_all(self, chunks):
        return Received(self.all_to_all(chunks))


class SubGroup:
    """Ranks ``members`` of ``parent`` (a group with ``start_send_recv``) as a group of
    their own: rank ``i`` is ``members[i]``, and its ring passes arrays from
    ``members[i]`` to ``members[i + 1]``. Sub-groups that do not overlap exchange at
    the same time, each within itself."""

    def __init__(self, parent, members):
        self.parent, self.members = parent, tuple(members)
        self.rank, self.size = self.members.index(parent.rank), len(self.members)

    def start_send_recv(self, arrays, to, source):
        return self.parent.start_send_recv(arrays, self.members[to], self.members[source])

    def start_exchange(self, arrays):
        return self.start_send_recv(
            arrays, (self.rank + 1) % self.size, (self.rank - 1) % self.size
        )

    def exchange(self, arrays):
        return self.start_exchange(arrays).wait()

    def start_all_to_all(self, chunks):
        native = getattr(self.parent, "start_all_to_all_among", None)
        if native is not None:
            return native(self.members, chunks)
        return Received(all_to_all(_RingOnly(self), chunks))

    def all_to_all(self, chunks):
        return self.start_all_to_all(chunks).wait()


class _RingOnly:
    """A group's ring exchange alone (no ``all_to_all``): :func:`all_to_all`'s fallback."""

    def __init__(self, group):
        self.rank, self.size, self._group = group.rank, group.size, group

    def exchange(self, arrays):
        return self._group.exchange(arrays)


def subgroup(group, members):
    """The ranks ``members`` (ranks of ``group``, this one among them) as a group:
    ``group`` itself for all of them in order, :class:`Alone` for this rank alone, else a
    :class:`SubGroup` (which needs ``group.start_send_recv``)."""
    members = tuple(members)
    if members == tuple(range(group.size)):
        return group
    if members == (group.rank,):
        return Alone()
    if not hasattr(group, "start_send_recv"):
        raise InvalidArgumentError(
            "group",
            f"{type(group).__name__} has no start_send_recv(arrays, to, source): it cannot "
            "run a ring over some of its ranks",
        )
    return SubGroup(group, members)


class _Aborted(Exception):
    """Another virtual rank failed while this one waited for its arrays."""


def _caller_device():
    """The CUDA device current in the calling thread where CuPy is loaded and sees a GPU,
    else None. A new thread has no CUDA context current until the runtime makes one: the
    driver's calls (a launch, a tensor map's encoding) failed there with
    CUDA_ERROR_INVALID_CONTEXT where no allocation had made it current first."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    try:
        return cupy.cuda.runtime.getDevice()
    except Exception:  # noqa: BLE001 - no driver or no GPU: no device to carry over
        return None


class ThreadGroup:
    """``size`` virtual ranks in one process, one thread each: ``run(fn, per_rank_args)``
    calls ``fn(group_of_rank, *args)`` on every rank at once and returns their results
    in rank order. Arrays pass from rank to rank without a copy (a rank never changes
    what it sent), through a mailbox for each ordered pair of ranks."""

    def __init__(self, size):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgumentError("size", f"expected an int >= 1, got {size!r}")
        self.size = size
        self.local_size = size  # every virtual rank shares this process's device
        self._ready = threading.Condition()
        self._mail = collections.defaultdict(collections.deque)
        self._failed = False
        self._finished: set[int] = set()

    def run(self, fn, per_rank_args):
        results, errors = [None] * self.size, []
        self._mail.clear()
        self._failed = False
        self._finished = set()
        device = _caller_device()

        def work(rank):
            try:
                if device is not None:  # the caller's device and its context, current here
                    sys.modules["cupy"].cuda.runtime.setDevice(device)
                results[rank] = fn(_ThreadRank(self, rank), *per_rank_args[rank])
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
                with self._ready:
                    self._failed = True
                    self._ready.notify_all()
            finally:
                with self._ready:
                    self._finished.add(rank)
                    self._ready.notify_all()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            real = [e for e in errors if not isinstance(e, _Aborted)]
            raise (real or errors)[0]
        return results

    def _post(self, source, to, arrays):
        with self._ready:
            self._mail[source, to].append(tuple(arrays))
            self._ready.notify_all()

    def _take(self, source, to):
        box = self._mail[source, to]
        with self._ready:
            while not box:
                if self._failed:
                    raise _Aborted(f"rank {to} waited for rank {source}, which failed")
                if source in self._finished:
                    raise RuntimeError(
                        f"rank {to} waits for arrays from rank {source}, which has returned "
                        "without sending them: the ranks' exchanges do not match"
                    )
                self._ready.wait()
            return box.popleft()


class _ThreadRank:
    def __init__(self, group, rank):
        self.group, self.rank, self.size = group, rank, group.size
        self.local_size = group.local_size

    def start_send_recv(self, arrays, to, source):
        self.group._post(self.rank, to, arrays)
        return Received(self.group._take(source, self.rank))

    def start_exchange(self, arrays):
        return self.start_send_recv(
            arrays, (self.rank + 1) % self.size, (self.rank - 1) % self.size
        )

    def exchange(self, arrays):
        return self.start_exchange(arrays).wait()

    def start_all_to_all_among(self, members, chunks):
        me = self.rank
        for member, chunk in zip(members, chunks):
            if member != me:
                self.group._post(me, member, chunk)
        return Received(
            [
                tuple(chunk) if member == me else self.group._take(member, me)
                for member, chunk in zip(members, chunks)
            ]
        )

    def start_all_to_all(self, chunks):
        return self.start_all_to_all_among(range(self.size), chunks)

    def all_to_all(self, chunks):
        return self.start_all_to_all(chunks).wait()


class NcclGroup:
    """One rank of a group over NCCL, one process a GPU.

    The communicator comes from ``cupyx.distributed.init_process_group`` (its TCP
    store on ``host:port``, rank 0 serving it). Arrays travel as bytes, with NCCL's
    sends and receives grouped so that every rank sends and receives at once, on a
    stream of the group's own: it waits for the work the current stream has queued,
    and :meth:`InFlight.wait` makes the current stream wait for the transfer. The
    kernels of a ring step therefore run while the next step's shards travel.

    Parameters
    ----------
    rank, size : int
        This process's rank and the number of processes (one GPU each).
    host, port : str, int, optional
        The TCP store's address (CuPy's defaults, or the ``CUPYX_DISTRIBUTED_HOST``
        and ``CUPYX_DISTRIBUTED_PORT`` environment variables, when None).
    local_size : int, optional
        Ranks on this rank's node, which NVLink joins (all of them when None): the
        hybrid mode's default keeps its all-to-all among them.
    """

    def __init__(self, rank, size, host=None, port=None, local_size=None):
        for name, value in (("rank", rank), ("size", size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(name, f"expected an int, got {value!r}")
        if size < 1 or not 0 <= rank < size:
            raise InvalidArgumentError(
                "rank", f"expected 0 <= rank < size, got rank {rank} of size {size}"
            )
        import cupy
        import cupyx.distributed

        self.rank, self.size = rank, size
        self.local_size = size if local_size is None else local_size
        options = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
        self._backend = cupyx.distributed.init_process_group(size, rank, **options)
        # The highest priority (CUDA clamps the value to the device's range): the
        # transfer's kernels take SMs as the attention kernel's blocks finish, rather
        # than after the whole kernel.
        self.stream = cupy.cuda.Stream(non_blocking=True, priority=HIGHEST_PRIORITY)

    @classmethod
    def from_environment(cls):
        """The group of the rank that torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
        ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) or mpirun
        (``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``) started; the
        process uses GPU ``LOCAL_RANK``. The TCP store listens on ``MASTER_PORT + 1``
        where torchrun's own store has ``MASTER_PORT``."""
        import cupy

        env = os.environ
        rank = int(env.get("RANK", env.get("OMPI_COMM_WORLD_RANK", 0)))
        size = int(env.get("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", 1)))
        local = int(env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", rank)))
        local_size = env.get("LOCAL_WORLD_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE"))
        cupy.cuda.Device(local).use()
        port = env.get("MASTER_PORT")
        return cls(
            rank,
            size,
            host=env.get("MASTER_ADDR"),
            port=int(port) + 1 if port else None,
            local_size=int(local_size) if local_size else None,
        )

    def _transfer(self, pairs):
        """Queue ``(array, to, source)`` sends and receives as one NCCL group on the
        group's stream, after the current stream's work; the :class:`InFlight`."""
        import cupy
        from cupy.cuda import nccl

        compute = cupy.cuda.get_current_stream()
        sent = tuple(cupy.ascontiguousarray(a) for a, _, _ in pairs)
        received = tuple(cupy.empty_like(a) for a in sent)
        self.stream.wait_event(compute.record())
        comm = self._backend._comm
        nccl.groupStart()
        for out, into, (_, to, source) in zip(sent, received, pairs):
            comm.send(out.data.ptr, out.nbytes, nccl.NCCL_UINT8, to, self.stream.ptr)
            comm.recv(into.data.ptr, into.nbytes, nccl.NCCL_UINT8, source, self.stream.ptr)
        nccl.groupEnd()
        return InFlight(sent, received, self.stream.record())

    def start_send_recv(self, arrays, to, source):
        """Send ``arrays`` to rank ``to`` and receive rank ``source``'s (the same shapes),
        on the group's stream; returns an :class:`InFlight` at once."""
        if to == self.rank and source == self.rank:
            return Received(arrays)
        return self._transfer([(a, to, source) for a in arrays])

    def start_exchange(self, arrays):
        """Send ``arrays`` to the next rank and receive the previous rank's."""
        return self.start_send_recv(
            arrays, (self.rank + 1) % self.size, (self.rank - 1) % self.size
        )

    def exchange(self, arrays):
        return self.start_exchange(arrays).wait()

    def start_all_to_all_among(self, members, chunks):
        """``chunks[j]`` to rank ``members[j]``, in one NCCL group on the group's stream
        (every chunk of one shape list on every member): a handle whose ``wait()`` gives
        what each member sent here, in member order."""
        pairs = [
            (a, member, member)
            for member, chunk in zip(members, chunks)
            if member != self.rank
            for a in chunk
        ]
        flight = self._transfer(pairs) if pairs else Received(())
        return _AllToAll(flight, [member == self.rank for member in members], chunks)

    def all_to_all_among(self, members, chunks):
        return self.start_all_to_all_among(members, chunks).wait()

    def start_all_to_all(self, chunks):
        return self.start_all_to_all_among(range(self.size), chunks)

    def all_to_all(self, chunks):
        return self.start_all_to_all(chunks).wait()


class _AllToAll:
    """An all-to-all in flight: ``wait()`` puts the received arrays back in their
    members' chunks (this rank's own chunk as it was)."""

    def __init__(self, flight, mine, chunks):
        self._flight, self._mine, self._chunks = flight, mine, chunks

    def wait(self):
        got = iter(self._flight.wait())
        return [
            tuple(chunk) if mine else tuple(next(got) for _ in chunk)
            for mine, chunk in zip(self._mine, self._chunks)
        ]


class InFlight:
    """A transfer queued on a group's stream.

    It holds the arrays being sent until :meth:`wait`: freed earlier, their memory
    could go to a new array of the current stream while the transfer still reads it.
    """

    def __init__(self, sent, received, done):
        self._sent, self._received, self._done = sent, received, done

    def wait(self):
        """The received arrays, once the current stream has been made to wait for the
        transfer (the host does not block)."""
        import cupy

        cupy.cuda.get_current_stream().wait_event(self._done)
        self._sent = None
        return self._received
