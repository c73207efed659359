"""The agent's files: the content-addressed cache of inputs, each job's private folder with its
inputs linked in, the listing of what a job left, and small files in bulk both ways.

A part of the agent (main.py): :class:`FileOperations` is mixed into its ``Agent``, whose state
(``root``, ``cache``, ``staged``, ``trust``...) it uses.  Runs on the hosts' python3 (3.8 or
newer): stdlib only, no 3.9+ syntax.  Every path a request names must lie in the work root;
every file is made or read through hostguard's checks (nothing followed through a link).
"""

import asyncio
import base64
import os
import shutil
import stat

from ssh_scheduler.agent import hostguard as G
from ssh_scheduler.agent import plumbing as IO
from ssh_scheduler.agent import protocol as P

CACHE_DIR = "cache"
JOBS_DIR = "jobs"


class FileOperations(object):
    """The agent's requests about files (mixed into main.Agent)."""

    async def op_have(self, req):
        """Which cache entries are missing.  An entry is trusted only when it is ours, a plain
        file, and its content hashes to its name (checked once per agent; in a thread, since
        inputs can be large); anything else is removed and reported missing."""
        loop = asyncio.get_event_loop()
        missing = await loop.run_in_executor(None, self.missing_from_cache, req.hashes, req.sizes)
        self.send(P.HaveReply(id=req.id, missing=missing))

    def missing_from_cache(self, keys, sizes):
        trust = self.trust
        if trust is None:
            trust = self.trust = G.CacheTrust(self.cache, os.path.join(self.root, "cache-trusted.json"))
        missing = [key for key in keys if not trust.check(key, sizes.get(key))]
        trust.save()
        return missing

    async def op_stage(self, req):
        self.stage(req.dir, req.files, req.dirs)
        self.send(P.Staged(id=req.id))

    def stage(self, jobdir, files, dirs):
        """Give a job its private directory, its inputs hard-linked from the cache.

        Cache files are read-only, so a job that rewrites an input in place gets EACCES (as a
        non-root user) rather than silently corrupting the copy every later job links to; the
        manifest check below catches the root case and evicts the entry.
        """
        if not self.inside_root(os.path.dirname(jobdir)):
            raise ValueError("job directory outside the work root")
        if os.path.lexists(jobdir):
            shutil.rmtree(jobdir, ignore_errors=True)  # left by an earlier, abandoned attempt
        os.makedirs(jobdir, mode=0o700)
        record = {}
        for rel in dirs:
            os.makedirs(os.path.join(jobdir, rel), exist_ok=True)
        for staged in files:
            rel, key = staged.rel, staged.key
            target = os.path.join(jobdir, rel)
            parent = os.path.dirname(target)
            if parent:
                os.makedirs(parent, exist_ok=True)
            source = os.path.join(self.cache, key)
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)
            st = os.lstat(target)
            record[rel] = (st.st_ino, st.st_mtime_ns, st.st_size, key)
        self.staged[jobdir] = record


    async def op_manifest(self, req):
        entries = self.list_results(req.dir, req.paths)
        self.send(P.ManifestReply(id=req.id, entries=P.encode_listing(entries)))

    def list_results(self, jobdir, explicit):
        """What to bring home from a job directory, never following a link.

        Without explicit paths: everything the job created or changed, i.e. not the untouched
        hard links to staged inputs.
        """
        staged = self.staged.get(jobdir, {})
        roots = explicit if explicit else ["."]
        entries = []
        seen = set()
        for top in roots:
            start = os.path.normpath(os.path.join(jobdir, top))
            if not (start == jobdir or start.startswith(jobdir + os.sep)):
                continue
            for rel, st in IO.walk(start, jobdir):
                if rel in seen:
                    continue
                seen.add(rel)
                kind = IO.kind_of(st.st_mode)
                link = None
                if kind == "link":
                    link = os.readlink(os.path.join(jobdir, rel))
                if kind == "file" and not explicit:
                    before = staged.get(rel)
                    if before is None and st.st_nlink > 1 and st.st_mode & 0o222 == 0:
                        continue  # an input staged by an agent that is gone (resumed batch)
                    if before is not None and before[0] == st.st_ino:
                        if before[1] == st.st_mtime_ns and before[2] == st.st_size:
                            continue  # an untouched input
                        # Rewritten in place through the shared link: the cache is spoiled.
                        try:
                            os.unlink(os.path.join(self.cache, before[3]))
                        except OSError:
                            pass
                if kind == "dir" and not explicit:
                    continue  # directories come along with the files in them
                entries.append(P.ManifestEntry(path=rel, kind=kind, size=st.st_size,
                                               mode=stat.S_IMODE(st.st_mode), link=link))
        return entries

    async def op_remove(self, req):
        path = req.dir
        job = self.jobs.get(req.job or "")
        if job is not None:
            if job.running:
                await self.kill_job(job, 2.0)
            for extra in (job.out_path, job.err_path):
                if extra and self.inside_root(os.path.dirname(extra)):
                    try:
                        os.unlink(extra)
                    except OSError:
                        pass
            self.jobs.pop(job.name, None)
        if self.inside_root(os.path.dirname(path)) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        self.staged.pop(path, None)
        if req.id is not None:
            self.send(P.Removed(id=req.id))

    async def op_sweep(self, req):
        """The batch is over: remove every job folder and output file it left here."""
        self.sweep(req.prefix)
        self.send(P.Swept(id=req.id))

    def sweep(self, prefix):
        jobs_dir = os.path.join(self.root, JOBS_DIR)
        busy = set(prefix + j.name for j in self.running_jobs())
        for name in os.listdir(jobs_dir):
            stem = name[:-4] if name.endswith((".out", ".err")) else name
            if not name.startswith(prefix) or stem in busy:
                continue
            path = os.path.join(jobs_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    # -- small files in bulk (transfer.py, bulk.py): many files per message, not per SFTP trip ---
    async def op_put(self, req):
        """Keep small inputs in the cache; each is checked against its hash before it counts."""
        trust = self.trust
        if trust is None:
            trust = self.trust = G.CacheTrust(self.cache, os.path.join(self.root, "cache-trusted.json"))
        failed = []
        for blob in req.files:
            try:
                why = G.keep_in_cache(self.cache, blob.name, base64.b64decode(blob.data or ""))
            except (OSError, ValueError) as exc:
                why = "%s: %s" % (type(exc).__name__, exc)
            if why is None:
                trust.learn(blob.name)
            else:
                failed.append("%s: %s" % (blob.name, why))
        trust.save()
        self.send(P.PutReply(id=req.id, failed=failed))

    async def op_fetch(self, req):
        """The bytes of small result files, in the order asked, ``limit`` + 1 bytes at most."""
        jobdir = os.path.normpath(req.dir)
        if not self.inside_root(os.path.dirname(jobdir)):
            raise ValueError("job directory outside the work root")
        left = req.limit + 1
        blobs = []
        for rel in req.paths:
            if left <= 0:
                break
            if rel.startswith("/") or "\0" in rel or ".." in rel.split("/"):
                blobs.append(P.Blob(name=rel, error="not a path inside the job folder"))
                continue
            data, error = G.read_regular(os.path.join(jobdir, rel), left)
            if data is not None:
                left -= len(data)
                data = base64.b64encode(data).decode()
            blobs.append(P.Blob(name=rel, data=data, error=error))
        self.send(P.Fetched(id=req.id, files=blobs))
