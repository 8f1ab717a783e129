# Sourced by scripts/build-linux-guest (x86_64) and scripts/build-aarch64-guest (arm64): a Debian
# kernel's build tree out of its headers packages, and the test module (fixtures/linux-guest/module,
# one source for every kernel and architecture) built against it.

# depends DEB: the names it depends on (first of alternatives, no versions).
depends() {
    { dpkg-deb --field "$1" Depends; dpkg-deb --field "$1" Pre-Depends; } |
        tr ',' '\n' | sed 's/|.*//; s/(.*//; s/:any//; s/[[:space:]]//g' | grep -v '^$' || true
}

# module_tree HEADERS TREE DEB...: the DEBs (linux-headers-<release>, its -common, a
# linux-kbuild) unpacked afresh into the folder HEADERS; TREE (HEADERS/usr/src/linux-headers-
# <release>) is their build tree, its Makefile pointed at the -common tree it names by absolute
# path (/usr/src/...) in HEADERS.
module_tree() {
    local headers=$1 tree=$2 deb
    shift 2
    rm -rf "$headers"
    for deb in "$@"; do
        dpkg-deb -x "$deb" "$headers"
    done
    sed -i "s|/usr/src/|$PWD/$headers/usr/src/|g" "$tree/Makefile"
}

# module_build TREE FOLDER [MAKE_ARG...]: the module's source copied into FOLDER and built against
# TREE (make's output in FOLDER.log); FOLDER/qmpprof_burn.ko keeps its symbols.
module_build() {
    module_build_from fixtures/linux-guest/module "$@"
}

# module_build_from SOURCE TREE FOLDER [MAKE_ARG...]: module_build of another module's source.
module_build_from() {
    local source=$1 tree=$2 folder=$3
    shift 3
    rm -rf "$folder"
    cp -r "$source" "$folder"
    make -s -C "$tree" M="$PWD/$folder" "$@" modules >"$folder.log" 2>&1
}
