"""Process groups for ring attention: what carries the K/V shards from rank to rank.

A group has ``rank``, ``size`` and ``exchange(arrays)``: send a tuple of arrays to
rank ``rank + 1`` and return the tuple of the same shapes and dtypes that rank
``rank - 1`` sent. A group may also have ``start_exchange(arrays)``, which returns at
once with a handle whose ``wait()`` gives that tuple: the ring then computes while the
arrays travel. :func:`start_exchange` gives every group that form.
"""

import os
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


class ThreadGroup:
    """``size`` virtual ranks in one process, one thread each: ``run(fn, per_rank_args)``
    calls ``fn(group_of_rank, *args)`` on every rank at once and returns their results
    in rank order. ``exchange`` passes the arrays around the ring without a copy (a rank
    never changes what it sent)."""

    def __init__(self, size):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgumentError("size", f"expected an int >= 1, got {size!r}")
        self.size = size
        self._slots = [None] * size
        self._barrier = threading.Barrier(size)

    def run(self, fn, per_rank_args):
        results, errors = [None] * self.size, []

        def work(rank):
            try:
                results[rank] = fn(_ThreadRank(self, rank), *per_rank_args[rank])
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (real or errors)[0]
        return results


class _ThreadRank:
    def __init__(self, group, rank):
        self.group, self.rank, self.size = group, rank, group.size

    def exchange(self, arrays):
        group = self.group
        group._slots[self.rank] = arrays
        group._barrier.wait()
        received = group._slots[(self.rank - 1) % self.size]
        group._barrier.wait()  # everyone has read before the slots are reused
        return received


class NcclGroup:
    """One rank of a ring over NCCL, one process a GPU.

    The communicator comes from ``cupyx.distributed.init_process_group`` (its TCP
    store on ``host:port``, rank 0 serving it). Arrays travel as bytes, with NCCL's
    send and receive grouped so that every rank sends and receives at once, on a
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
    """

    def __init__(self, rank, size, host=None, port=None):
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
        options = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
        self._backend = cupyx.distributed.init_process_group(size, rank, **options)
        # The highest priority (CUDA clamps the value to the device's range): the
        # transfer's kernels take SMs as the attention kernel's blocks finish, rather
        # than after the whole kernel.
        self.stream = cupy.cuda.Stream(non_blocking=True, priority=HIGHEST_PRIORITY)

    @classmethod
    def from_environment(cls):
        """The group of the rank that torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
        ``MASTER_ADDR``, ``MASTER_PORT``) or mpirun (``OMPI_COMM_WORLD_RANK``, ``_SIZE``,
        ``_LOCAL_RANK``) started; the process uses GPU ``LOCAL_RANK``. The TCP store
        listens on ``MASTER_PORT + 1`` where torchrun's own store has ``MASTER_PORT``."""
        import cupy

        env = os.environ
        rank = int(env.get("RANK", env.get("OMPI_COMM_WORLD_RANK", 0)))
        size = int(env.get("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", 1)))
        local = int(env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", rank)))
        cupy.cuda.Device(local).use()
        port = env.get("MASTER_PORT")
        return cls(rank, size, host=env.get("MASTER_ADDR"), port=int(port) + 1 if port else None)

    def start_exchange(self, arrays):
        """Send ``arrays`` to the next rank and receive the previous rank's, on the
        group's stream; returns an :class:`InFlight` at once."""
        import cupy
        from cupy.cuda import nccl

        if self.size == 1:
            return Received(arrays)
        compute = cupy.cuda.get_current_stream()
        sent = tuple(cupy.ascontiguousarray(a) for a in arrays)
        received = tuple(cupy.empty_like(a) for a in sent)
        self.stream.wait_event(compute.record())
        comm = self._backend._comm
        nccl.groupStart()
        for out, into in zip(sent, received):
            comm.send(
                out.data.ptr,
                out.nbytes,
                nccl.NCCL_UINT8,
                (self.rank + 1) % self.size,
                self.stream.ptr,
            )
            comm.recv(
                into.data.ptr,
                into.nbytes,
                nccl.NCCL_UINT8,
                (self.rank - 1) % self.size,
                self.stream.ptr,
            )
        nccl.groupEnd()
        return InFlight(sent, received, self.stream.record())

    def exchange(self, arrays):
        return self.start_exchange(arrays).wait()


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
