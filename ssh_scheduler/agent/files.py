"""The agent's files: the content-addressed cache of inputs, each job's private folder with its
inputs linked in, the listing of what a job left, and small files in bulk both ways.

A part of the agent (main.py): :class:`FileOperations` is mixed into its ``Agent``, whose state
(``work``, ``root``, ``staged``, ``trust``...) it uses.  Runs on the hosts' python3 (3.8 or
newer): stdlib only, no 3.9+ syntax.  Every path a request names must lie in the work root (a
job's folder is ``<root>/jobs/<name>``); what it names is opened below the root's verified
descriptors, one name at a time, never through a link (rooted.py).
"""

import asyncio
import base64
import os
import stat

from ssh_scheduler.agent import hostguard as G
from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import rooted as R


class MissingInputs(Exception):
    """Cache entries a staging needs are not there any more (one was spoiled by a job that wrote
    through its link, and removed): the coordinator sends them again (``keys``), the host is
    not at fault."""

    def __init__(self, keys):
        Exception.__init__(self, "%d input(s) missing from the host's cache" % len(keys))
        self.keys = keys


class FileOperations(object):
    """The agent's requests about files (mixed into main.Agent)."""

    def cache_trust(self):
        if self.trust is None:
            self.trust = G.CacheTrust(self.work.cache, self.work.fd)
        return self.trust

    def job_folder(self, path):
        """The name, in the jobs folder, of the job folder (or its ``.out``/``.err``) that
        ``path`` names; ValueError for any other path."""
        rel = self.below_root(path)
        parts = rel.split("/")
        if len(parts) != 2 or parts[0] != G.JOBS_DIR or R.names(parts[1]) != [parts[1]]:
            raise ValueError("%r is not a job folder of the work root" % (path,))
        return parts[1]

    async def op_have(self, req):
        """Which cache entries are missing.  An entry is trusted only when it is ours, a plain
        file, and its content hashes to its name (checked once per agent; in a thread, since
        inputs can be large); anything else is removed and reported missing."""
        loop = asyncio.get_event_loop()
        missing = await loop.run_in_executor(None, self.missing_from_cache, req.hashes, req.sizes)
        self.send(P.HaveReply(id=req.id, missing=missing))

    def missing_from_cache(self, keys, sizes):
        trust = self.cache_trust()
        missing = [key for key in keys if not trust.check(key, sizes.get(key))]
        trust.save()
        return missing

    async def op_stage(self, req):
        self.stage(req.dir, req.files, req.dirs)
        self.send(P.Staged(id=req.id))

    def stage(self, jobdir, files, dirs):
        """Give a job its private folder, its inputs hard-linked from the cache.

        Cache files are read-only, so a job that rewrites an input in place gets EACCES (as a
        non-root user).  One that writes anyway (as root, or after a chmod) changes the entry
        every link shares: an entry is linked only while it is as it was checked
        (CacheTrust.usable), else removed and reported (MissingInputs) for the coordinator to
        send again; the listing below also removes it as soon as the job that wrote it ends.
        """
        name = self.job_folder(jobdir)
        jobs = self.work.jobs
        R.remove(jobs, name)  # left by an earlier, abandoned attempt
        os.mkdir(name, 0o700, dir_fd=jobs)
        folder = R.open_child(jobs, name)
        trust = self.cache_trust()
        record = {}
        missing = []
        # The folder of the previous file stays open: files come folder by folder (the walk's
        # order), and opening each one's folders anew was most of a big tree's staging.
        above, parent = None, -1
        try:
            for rel in dirs:
                parts = R.names(rel)
                if parts is None:
                    raise ValueError("%r is not a path inside the job folder" % (rel,))
                os.close(R.open_folder(folder, parts, create=True))
            for staged in files:
                parts, key = R.names(staged.rel), staged.key
                if not parts:
                    raise ValueError("%r is not a path inside the job folder" % (staged.rel,))
                if not trust.usable(key):
                    missing.append(key)
                    continue
                if parts[:-1] != above:
                    if parent >= 0:
                        os.close(parent)
                        parent = -1
                    parent, above = R.open_folder(folder, parts[:-1], create=True), parts[:-1]
                last = parts[-1]
                try:
                    os.link(key, last, src_dir_fd=self.work.cache, dst_dir_fd=parent,
                            follow_symlinks=False)
                except OSError:
                    R.copy_file(self.work.cache, key, parent, last, 0o500 if key.endswith("-x") else 0o400)
                st = os.stat(last, dir_fd=parent, follow_symlinks=False)
                record["/".join(parts)] = (st.st_ino, st.st_mtime_ns, st.st_size, key)
        finally:
            if parent >= 0:
                os.close(parent)
            os.close(folder)
        trust.save()
        if missing:
            raise MissingInputs(missing)
        self.staged[jobdir] = record

    async def op_manifest(self, req):
        entries = self.list_results(req.dir, req.paths)
        self.send(P.ManifestReply(id=req.id, entries=P.encode_listing(entries)))

    def list_results(self, jobdir, explicit):
        """What to bring home from a job folder, never following a link (at any name).

        Without explicit paths: everything the job created or changed, i.e. not the untouched
        hard links to staged inputs.
        """
        name = self.job_folder(jobdir)
        staged = self.staged.get(jobdir, {})
        try:
            folder = R.open_child(self.work.jobs, name)
        except OSError:
            return []
        entries = []
        seen = set()
        try:
            for top in explicit if explicit else ["."]:
                parts = R.names(os.path.normpath(top))
                if parts is None:
                    continue  # would leave the job folder
                for rel, st in R.walk(folder, parts):
                    if rel in seen:
                        continue
                    seen.add(rel)
                    entry = self.listed(folder, rel, st, staged, explicit)
                    if entry is not None:
                        entries.append(entry)
        finally:
            os.close(folder)
        return entries

    def listed(self, folder, rel, st, staged, explicit):
        kind = R.kind_of(st.st_mode)
        if kind == "file" and not explicit:
            before = staged.get(rel)
            if before is None and st.st_nlink > 1 and st.st_mode & 0o222 == 0:
                return None  # an input staged by an agent that is gone (resumed batch)
            if before is not None and before[0] == st.st_ino:
                if before[1] == st.st_mtime_ns and before[2] == st.st_size:
                    return None  # an untouched input
                # Rewritten in place through the shared link: the cache entry is spoiled.
                self.cache_trust().evict(before[3], st.st_ino)
        if kind == "dir" and not explicit:
            return None  # directories come along with the files in them
        link = R.read_link(folder, rel) if kind == "link" else None
        return P.ManifestEntry(path=rel, kind=kind, size=st.st_size, mode=stat.S_IMODE(st.st_mode), link=link)

    async def op_remove(self, req):
        path = req.dir
        job = self.jobs.get(req.job or "")
        if job is not None:
            if job.running:
                await self.kill_job(job, 2.0)
            for extra in (job.out_path, job.err_path):
                try:
                    os.unlink(self.job_folder(extra), dir_fd=self.work.jobs)
                except (OSError, ValueError, TypeError):
                    pass
            self.jobs.pop(job.name, None)
        try:
            R.remove(self.work.jobs, self.job_folder(path))
        except ValueError:
            pass
        self.staged.pop(path, None)
        if req.id is not None:
            self.send(P.Removed(id=req.id))

    async def op_sweep(self, req):
        """The batch is over: remove every job folder and output file it left here."""
        self.sweep(req.prefix)
        self.send(P.Swept(id=req.id))

    def sweep(self, prefix):
        jobs = self.work.jobs
        busy = set(prefix + j.name for j in self.running_jobs())
        for name in os.listdir(jobs):
            stem = name[:-4] if name.endswith((".out", ".err")) else name
            if name.startswith(prefix) and stem not in busy:
                R.remove(jobs, name)

    # -- small files in bulk (transfer.py, bulk.py): many files per message, not per SFTP trip ---
    async def op_put(self, req):
        """Keep small inputs in the cache; each is checked against its hash before it counts.
        Written in a thread: a message of 2,000 files is ~0.1 s of work, during which the loop
        goes on with the jobs (their ends, their output), and the next message's files are
        written beside these (each write waits on the disk, not on the interpreter)."""
        trust = self.cache_trust()  # made here, on the loop: a thread would race to make it
        loop = asyncio.get_event_loop()
        self.putting += 1
        try:
            failed = await loop.run_in_executor(None, self.keep_all, trust, req.files)
        finally:
            self.putting -= 1
        # The record is the whole cache's: saved once the last message of a burst is kept, not
        # after each (a dataset of 100,000 files, 50 messages, rewrote ~300 MB of it).  A record
        # that misses entries costs a later agent their hashing, never a wrong input.
        if not self.putting:
            await loop.run_in_executor(None, trust.save)
        self.send(P.PutReply(id=req.id, failed=failed))

    def keep_all(self, trust, files):
        """(in a thread) Each blob into the cache; why each one that was not kept was not."""
        failed = []
        for blob in files:
            try:
                why = G.keep_in_cache(self.work.cache, blob.name, base64.b64decode(blob.data or ""))
            except (OSError, ValueError) as exc:
                why = "%s: %s" % (type(exc).__name__, exc)
            if why is None:
                trust.learn(blob.name)
            else:
                failed.append("%s: %s" % (blob.name, why))
        return failed

    async def op_fetch(self, req):
        """The bytes of small result files, in the order asked, ``limit`` + 1 bytes at most;
        each opened below the job's folder, one name at a time, never through a link."""
        name = self.job_folder(os.path.normpath(req.dir))
        left = req.limit + 1
        blobs = []
        folder = R.open_child(self.work.jobs, name)
        try:
            for rel in req.paths:
                if left <= 0:
                    break
                data, error = R.read_regular(folder, rel, left)
                if data is not None:
                    left -= len(data)
                    data = base64.b64encode(data).decode()
                blobs.append(P.Blob(name=rel, data=data, error=error))
        finally:
            os.close(folder)
        self.send(P.Fetched(id=req.id, files=blobs))
