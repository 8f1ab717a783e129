"""A Linux process's executable mappings, read from its ``mm``: where each program and shared
library is (start, end, file offset, file name), so that PIE executables and libraries are
placed and named without help from the guest.

The VMAs are in ``mm->mm_mt``, a maple tree (6.1 on), or the ``mm->mmap`` list (before). A
maple node is aligned to its size (``struct maple_node``, 256 bytes) and an encoded node pointer
holds its type (``enum maple_type``: both from BTF) in bits 3-6, the root's also bit 1 (an
"internal" entry): those two are the only facts no description carries (lib/maple_tree.c's
MAPLE_NODE_TYPE_SHIFT and MAPLE_NODE_TYPE_MASK, the same in 6.1, 6.12 and 7.2). Leaves
(``maple_leaf_64``) hold the VMA pointers; ranges (``maple_range_64``) and allocation ranges
(``maple_arange_64``) hold their children, encoded the same way. Slots of nodes and leaves are
read whole and checked (a VMA must point back at this ``mm`` and span a user range, below
``user_end``: where user space ends depends on the paging mode), so stale slots past a node's
end do no harm. Offsets come from BTF.

Reads go through a ``Reader``: a list of ranges read together (one round trip over the gdbstub).

A process may hold 65,530 mappings (``vm.max_map_count``: JVMs, databases, sanitizers reach it):
reading them all is a walk of thousands of nodes. ``find_exec_vmas`` reads only the mappings
that hold given addresses, by a descent of the tree as the kernel's own lookup does (the maple
tree's pivots; before 6.1 the ``mm_rb`` red-black tree): work proportional to the tree's height,
for a pause. ``map_count`` says how many a process has.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from qmpprof.linux.btf import Btf, Kind
from qmpprof.memory import Reader, read_ints

# vm_flags: an executable mapping (include/linux/mm.h, the same from 5.10 to 7.2; BTF carries no
# #define).
VM_EXEC = 0x4
MAX_VMAS = 65536
STEP = 64  # ranges a step of a walk between samples reads at most
BY_PAGE = 256  # VMAs past which a walk reads them by the page (some 20 a slab page)
_MAX_HEIGHT = 31  # MAPLE_HEIGHT_MAX: a deeper walk is going round a loop of nodes
_NAME_MAX = 256
_PAGE = 4096
# An encoded maple node's type: bits 3-6 (lib/maple_tree.c, 6.1 to 7.2).
_TYPE_SHIFT, _TYPE_MASK = 3, 0xF


@dataclass(frozen=True, slots=True)
class VmaLayout:
    """Byte offsets for mm_struct, vm_area_struct, file and dentry, from BTF."""

    maple: bool  # mm_mt (a maple tree) rather than the mmap list
    vmas: int  # mm_struct.mm_mt.ma_root, or mm_struct.mmap
    vm_next: int  # vm_area_struct.vm_next (the list only)
    leaf_slots: tuple[int, int]  # (offset, count) of the slots of maple_range_64
    arange_slots: tuple[int, int]  # and of maple_arange_64
    node_size: int  # struct maple_node: a node's size and alignment
    types: tuple[int, int, int]  # enum maple_type: maple_leaf_64, maple_range_64, and arange
    vm_start: int
    vm_end: int
    vm_mm: int
    vm_flags: int
    vm_pgoff: int
    vm_file: int
    dentry: int  # file.f_path.dentry
    name: int  # dentry.d_name.name
    pgd: int  # mm_struct.pgd: the process's top-level page table (a kernel address)
    map_count: int  # mm_struct.map_count: how many mappings (an int)
    pivots: tuple[int, int]  # offset of the pivots of maple_range_64 and maple_arange_64
    rb_root: int  # mm_struct.mm_rb.rb_node (the rbtree only)
    vm_rb: int  # vm_area_struct.vm_rb: its rb_node (__rb_parent_color, rb_right, rb_left)

    @classmethod
    def from_btf(cls, btf: Btf) -> VmaLayout:
        """Raises KeyError naming what this kernel's BTF lacks."""
        field = btf.offset_of
        try:
            vmas = field("mm_struct.mm_mt") + field("maple_tree.ma_root")
            maple, vm_next = True, 0
            range_slot = btf.field("maple_range_64.slot")
            arange_slot = btf.field("maple_arange_64.slot")
            leaf = (range_slot.offset, btf.array(range_slot.type_id)[1])
            arange = (arange_slot.offset, btf.array(arange_slot.type_id)[1])
            node_size = btf.size_of(btf.struct("maple_node").id)
            types = _maple_types(btf)
            pivots = (field("maple_range_64.pivot"), field("maple_arange_64.pivot"))
            rb_root = vm_rb = 0
        except KeyError:
            vmas, maple, vm_next = field("mm_struct.mmap"), False, field("vm_area_struct.vm_next")
            leaf = arange = pivots = (0, 0)
            node_size, types = 0, (0, 0, 0)
            rb_root = field("mm_struct.mm_rb") + field("rb_root.rb_node")
            vm_rb = field("vm_area_struct.vm_rb")
        return cls(
            maple=maple,
            vmas=vmas,
            vm_next=vm_next,
            leaf_slots=leaf,
            arange_slots=arange,
            node_size=node_size,
            types=types,
            vm_start=field("vm_area_struct.vm_start"),
            vm_end=field("vm_area_struct.vm_end"),
            vm_mm=field("vm_area_struct.vm_mm"),
            vm_flags=field("vm_area_struct.vm_flags"),
            vm_pgoff=field("vm_area_struct.vm_pgoff"),
            vm_file=field("vm_area_struct.vm_file"),
            dentry=field("file.f_path") + field("path.dentry"),
            name=field("dentry.d_name") + field("qstr.name"),
            pgd=field("mm_struct.pgd"),
            map_count=field("mm_struct.map_count"),
            pivots=pivots,
            rb_root=rb_root,
            vm_rb=vm_rb,
        )


@dataclass(frozen=True, slots=True)
class Vma:
    start: int
    end: int
    pgoff: int  # file offset / 4096
    flags: int
    file: int  # struct file *, 0 when anonymous
    name: str | None  # the file's name (its last path component)

    @property
    def exec(self) -> bool:
        return bool(self.flags & VM_EXEC)


def _maple_types(btf: Btf) -> tuple[int, int, int]:
    found = btf.find("maple_type", Kind.ENUM)
    if found is None:
        raise KeyError("enum maple_type")
    values = btf.enum_values(found)
    return values["maple_leaf_64"], values["maple_range_64"], values["maple_arange_64"]


async def read_exec_vmas(read: Reader, mm: int, layout: VmaLayout, user_end: int) -> list[Vma]:
    """The executable mappings of the address space ``mm``, by start address, with names;
    user space ends at ``user_end``. Read STEP ranges a request at most: a transport serves a
    request's ranges at once (QMP: a file each), never 65,536 of them."""
    walk = VmaWalk(mm, layout, user_end)
    while not await walk.step(read):
        pass
    return walk.found or []


class VmaWalk:
    """The executable mappings of ``mm`` read a part at a time: each ``step`` reads at most
    ``limit`` ranges (the tree's nodes breadth first, or the list's links; then the VMAs; then
    their files' names), so that the 65,530 mappings of a process are read between samples over
    many steps, none keeping a tick waiting long. ``found``: the mappings, once done."""

    def __init__(self, mm: int, layout: VmaLayout, user_end: int) -> None:
        self.mm, self.layout, self.user_end = mm, layout, user_end
        # Maple nodes, or the list's next VMA, to read (None: the root not read yet).
        self.pending: deque[int] | None = None
        self.seen: set[int] = set()  # one met twice is a loop (a pointer read mid-change)
        self.pointers: list[int] = []  # the VMAs found
        self.raws: list[bytes | None] = []  # and read, in their order
        self.found: list[Vma] | None = None

    async def step(self, read: Reader, limit: int = STEP) -> bool:
        """One part of the walk; True when it is done."""
        if self.found is not None:
            return True
        if self.pending is None:
            await self._root(read)
        elif self.pending and self.layout.maple:
            await self._nodes(read, limit)
        elif self.pending:
            await self._links(read, limit)
        elif len(self.raws) < len(self.pointers):
            rest, span = self.pointers[len(self.raws) :], _span(self.layout)
            if len(self.pointers) > BY_PAGE:
                self.raws += await _read_pages(read, rest, span, limit)
            else:  # a few: the bytes of each alone (a pause's reads cost by the byte)
                self.raws += await read([(p, span) for p in rest[:limit]])
        else:
            self.found = await _named(read, self.raws, self.mm, self.layout, self.user_end)
        return self.found is not None

    async def _root(self, read: Reader) -> None:
        (root,) = await read_ints(read, [(self.mm + self.layout.vmas, 8)])
        self.pending = deque()
        if not root:
            return
        if not self.layout.maple or _is_node(root):
            self.seen.add(root)
            self.pending.append(root)
        elif not _is_internal(root):  # a tree of one entry holds it in the root itself
            self.pointers.append(root)

    async def _nodes(self, read: Reader, limit: int) -> None:
        """Up to ``limit`` of the maple nodes pending: a leaf's slots are VMA pointers, other
        nodes' slots their children (encoded: node-aligned address | type << 3 | flags)."""
        assert self.pending is not None
        layout = self.layout
        leaf, _, arange = layout.types
        nodes = [self.pending.popleft() for _ in range(min(limit, len(self.pending)))]
        spans = [layout.arange_slots if _type(e) == arange else layout.leaf_slots for e in nodes]
        node_mask = layout.node_size - 1
        ranges = [(e & ~node_mask, off + 8 * n) for e, (off, n) in zip(nodes, spans, strict=True)]
        for node, raw, (off, count) in zip(nodes, await read(ranges), spans, strict=True):
            if raw is None:
                continue
            slots = [_u64(raw, off + 8 * i) for i in range(count)]
            if _type(node) == leaf:
                self.pointers += [e for e in slots if e > 4096 and not _is_internal(e)]
            else:
                for child in slots:
                    self._push(child, child > 4096 and _type(child) in layout.types)
        if len(self.pointers) >= MAX_VMAS:
            del self.pointers[MAX_VMAS:]
            self.pending.clear()

    async def _links(self, read: Reader, limit: int) -> None:
        """Up to ``limit`` links of the list (one read each: a list is read in its order)."""
        assert self.pending is not None
        while self.pending and limit > 0:
            vma, limit = self.pending.popleft(), limit - 1
            self.pointers.append(vma)
            (following,) = await read_ints(read, [(vma + self.layout.vm_next, 8)])
            self._push(following or 0, bool(following) and len(self.pointers) < MAX_VMAS)

    def _push(self, entry: int, wanted: bool) -> None:
        assert self.pending is not None
        if wanted and entry not in self.seen and len(self.seen) < MAX_VMAS:
            self.seen.add(entry)
            self.pending.append(entry)


async def find_exec_vmas(
    read: Reader, mm: int, layout: VmaLayout, user_end: int, addrs: Sequence[int]
) -> list[Vma]:
    """The executable mappings of ``mm`` that hold the user addresses ``addrs``, by start
    address, found by a descent of its tree: a few reads a level, however many it holds."""
    addrs = sorted({a for a in addrs if 0 < a < user_end})
    if not addrs:
        return []
    (root,) = await read_ints(read, [(mm + (layout.vmas if layout.maple else layout.rb_root), 8)])
    if not root:
        return []
    if layout.maple:
        pointers = await _maple_lookup(read, root, layout, addrs)
    else:
        pointers = await _rb_lookup(read, root, layout, addrs)
    return [
        v
        for v in await _exec_vmas(read, pointers, mm, layout, user_end)
        if any(v.start <= a < v.end for a in addrs)
    ]


async def _maple_lookup(read: Reader, root: int, layout: VmaLayout, addrs: list[int]) -> list[int]:
    """The leaf entries holding ``addrs``, each found as mtree_lookup_walk does: in a node, the
    first slot whose pivot (its last index) reaches the address; a pivot of 0 past the first
    or the last slot, which has none, reaches the node's end."""
    if not _is_node(root):
        return [root] if root and not _is_internal(root) else []
    leaf, _, arange = layout.types
    walks = [(a, root) for a in addrs]
    out: list[int] = []
    for _ in range(_MAX_HEIGHT):
        walks = [(a, e) for a, e in walks if e > 4096 and _type(e) in layout.types]
        if not walks:
            break
        shapes = [_shape(layout, _type(e) == arange) for _, e in walks]
        ranges = [(e & ~(layout.node_size - 1), layout.node_size) for _, e in walks]
        raws = await read(ranges)
        following = []
        for (addr, node), raw, (pivots, slots, count) in zip(walks, raws, shapes, strict=True):
            if raw is None:
                continue
            slot = 0
            while slot < count - 1:
                pivot = _u64(raw, pivots + 8 * slot)
                if pivot >= addr or (pivot == 0 and slot > 0):
                    break
                slot += 1
            entry = _u64(raw, slots + 8 * slot)
            if _type(node) == leaf:
                out += [entry] if entry > 4096 and not _is_internal(entry) else []
            else:
                following.append((addr, entry))
        walks = following
    return out


def _shape(layout: VmaLayout, is_arange: bool) -> tuple[int, int, int]:
    """Offsets of a node's pivots and slots, and its count of slots."""
    slots, count = layout.arange_slots if is_arange else layout.leaf_slots
    return layout.pivots[1 if is_arange else 0], slots, count


async def _rb_lookup(read: Reader, root: int, layout: VmaLayout, addrs: list[int]) -> list[int]:
    """The VMAs holding ``addrs``, found down ``mm_rb`` as find_vma does: a node's left
    subtree holds the lower addresses."""
    span = max(layout.vm_start, layout.vm_end, layout.vm_rb + 16) + 8
    walks, out = [(a, root) for a in addrs], []
    for _ in range(2 * _MAX_HEIGHT):  # a red-black tree is at most twice as deep as balanced
        walks = [(a, node) for a, node in walks if node > 4096]
        if not walks:
            break
        vmas = [node - layout.vm_rb for _, node in walks]
        raws = await read([(vma, span) for vma in vmas])
        following = []
        for (addr, _), vma, raw in zip(walks, vmas, raws, strict=True):
            if raw is None:
                continue
            start, end = _u64(raw, layout.vm_start), _u64(raw, layout.vm_end)
            if start <= addr < end:
                out.append(vma)
            else:  # rb_right, then rb_left, after __rb_parent_color
                child = layout.vm_rb + (16 if addr < start else 8)
                following.append((addr, _u64(raw, child)))
        walks = following
    return out


async def _read_pages(read: Reader, at: list[int], size: int, limit: int) -> list[bytes | None]:
    """``size`` bytes at each of the first of ``at``, read as the pages that hold them, at most
    ``limit`` runs of pages: a slab page holds some 20 VMAs, read once for all of them."""
    runs: dict[int, int] = {}  # first page -> bytes, of each run read
    taken = 0
    for addr in at:
        first = addr - addr % _PAGE
        length = (addr + size - first + _PAGE - 1) // _PAGE * _PAGE
        if runs.get(first, 0) < length:
            if first not in runs and len(runs) == limit:
                break
            runs[first] = length
        taken += 1
    pages = dict(zip(runs, await read(list(runs.items())), strict=True))
    out: list[bytes | None] = []
    for addr in at[:taken]:
        page = pages[addr - addr % _PAGE]
        offset = addr % _PAGE
        out.append(None if page is None else page[offset : offset + size])
    return out


async def _exec_vmas(
    read: Reader, pointers: Sequence[int], mm: int, layout: VmaLayout, user_end: int
) -> list[Vma]:
    raws = await read([(p, _span(layout)) for p in dict.fromkeys(pointers)])
    return await _named(read, raws, mm, layout, user_end)


def _span(layout: VmaLayout) -> int:
    """Bytes of a vm_area_struct read: up to its last field read."""
    return max(layout.vm_start, layout.vm_end, layout.vm_mm, layout.vm_flags, layout.vm_pgoff,
               layout.vm_file) + 8  # fmt: skip


async def _named(
    read: Reader, raws: Sequence[bytes | None], mm: int, layout: VmaLayout, user_end: int
) -> list[Vma]:
    """The executable mappings of ``mm`` among the VMAs read (``raws``), with their names."""
    found = []
    for raw in raws:
        if raw is None:
            continue
        start, end, owner, flags, pgoff, file = (
            _u64(raw, offset)
            for offset in (layout.vm_start, layout.vm_end, layout.vm_mm, layout.vm_flags,
                           layout.vm_pgoff, layout.vm_file)
        )  # fmt: skip
        if owner == mm and start < end <= user_end and flags & VM_EXEC:
            found.append((start, end, pgoff, flags, file))
    names = await _file_names(read, [file for *_, file in found], layout)
    vmas = [
        Vma(start, end, pgoff, flags, file, names.get(file))
        for start, end, pgoff, flags, file in found
    ]
    return sorted(set(vmas), key=lambda v: v.start)


async def _file_names(read: Reader, files: list[int], layout: VmaLayout) -> dict[int, str]:
    files = sorted({f for f in files if f})
    dentries = await read([(f + layout.dentry, 8) for f in files])
    pairs = [(f, _u64(d, 0)) for f, d in zip(files, dentries, strict=True) if d is not None]
    name_ptrs = await read([(d + layout.name, 8) for _, d in pairs])
    named = [(f, _u64(p, 0)) for (f, _), p in zip(pairs, name_ptrs, strict=True) if p is not None]
    # A name ends before its page does, nearly always: a read never runs into the next page.
    texts = await read([(p, min(_NAME_MAX, _PAGE - p % _PAGE)) for _, p in named])
    out = {}
    for (f, _), text in zip(named, texts, strict=True):
        if text is not None and b"\0" in text:
            out[f] = text.split(b"\0", 1)[0].decode("utf-8", "replace")
    return out


def _is_internal(entry: int) -> bool:
    return entry & 3 == 2


def _is_node(entry: int) -> bool:
    return _is_internal(entry) and entry > 4096


def _type(entry: int) -> int:
    return (entry >> _TYPE_SHIFT) & _TYPE_MASK


def _u64(data: bytes, offset: int) -> int:
    return int(struct.unpack_from("<Q", data, offset)[0])
