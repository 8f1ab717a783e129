# Sourced by scripts/fetch-linux, scripts/fetch-linux-dbg and scripts/build-linux-guest: the
# Debian kernel series the tests boot, where each one's files go and which suite ships it.
#
#   series  folder                      image package                        suite
#   6.12    fixtures/build/linux        linux-image-6.12.N+deb12-amd64       bookworm (the host's)
#   6.1     fixtures/build/linux-6.1    linux-image-6.1.0-N-amd64            bookworm
#   5.10    fixtures/build/linux-5.10   linux-image-5.10.0-N-amd64           bullseye
#   7       fixtures/build/linux-7      linux-image-7.M.N+debNN-amd64        unstable
#
# and the arm64 kernels the aarch64 tests boot (AARCH64_SERIES; scripts/build-aarch64-guest):
#
#   arm64-6.1   fixtures/build/linux-arm64-6.1  linux-image-6.1.0-N-arm64          bookworm (arm64)
#   arm64-6.12  fixtures/build/linux-arm64      linux-image-6.12.N+deb12-arm64     bookworm (arm64)
#
# and the arm64 kernel whose code the unit tests read but no test boots yet (AARCH64_READ_SERIES:
# no test module is built for it, and bookworm's cross compiler and host kbuild are not its own):
#
#   arm64-7     fixtures/build/linux-arm64-7    linux-image-7.M.N+debNN-arm64      unstable (arm64)
#
# and the riscv64 kernel the riscv64 tests boot (RISCV64_SERIES; scripts/build-riscv64-guest):
#
#   riscv64-6.12  fixtures/build/linux-riscv64  linux-image-6.12.N+deb13-riscv64   trixie (riscv64)
#
# Only the generic flavour (not -cloud-amd64, -rt-amd64, -rt-arm64, -16k-arm64). An arm64 series is read through a
# private apt state of its suite with apt's architecture set to arm64 (series_arch).
#
# Only the generic amd64 flavour (not -cloud-amd64, -rt-amd64). A suite other than the host's is
# read through a private apt state, one per suite and architecture shared by every script
# (fixtures/build/apt/<suite>-<arch>: apt_state): a sources list, package lists and a cache of
# its own (apt checks the suite's signatures with the host's debian-archive-keyring as for any
# source). The host's apt sources and lists are never changed by it, and nothing from another
# suite is installed on the host: packages are only downloaded and unpacked into fixtures/build.

LINUX_SERIES="6.12 6.1 5.10 7"
AARCH64_SERIES="arm64-6.1 arm64-6.12"
AARCH64_READ_SERIES="arm64-7"
RISCV64_SERIES="riscv64-6.12"

# series_use SERIES: sets series_dir, series_pattern (an ERE for the image package's name),
# series_suite (empty: the host's own sources), series_arch (the Debian architecture), series_state
# (its private apt state; empty for the host's sources) and apt_opts (options for apt-get and
# apt-cache).
series_use() {
    series_suite= series_arch=amd64
    case "$1" in
    6.12) series_dir=fixtures/build/linux series_pattern='^linux-image-6\.12\.[0-9]+\+deb12-amd64$' ;;
    6.1) series_dir=fixtures/build/linux-6.1 series_pattern='^linux-image-6\.1\.0-[0-9]+-amd64$' ;;
    5.10)
        series_dir=fixtures/build/linux-5.10 series_pattern='^linux-image-5\.10\.0-[0-9]+-amd64$'
        series_suite=bullseye
        ;;
    7)
        series_dir=fixtures/build/linux-7
        series_pattern='^linux-image-7\.[0-9]+\.[0-9]+(\+deb[0-9]+|-[0-9]+)-amd64$'
        series_suite=unstable
        ;;
    arm64-6.1)
        series_dir=fixtures/build/linux-arm64-6.1 series_pattern='^linux-image-6\.1\.0-[0-9]+-arm64$'
        series_suite=bookworm series_arch=arm64
        ;;
    arm64-6.12)
        series_dir=fixtures/build/linux-arm64 series_pattern='^linux-image-6\.12\.[0-9]+\+deb12-arm64$'
        series_suite=bookworm series_arch=arm64
        ;;
    arm64-7)
        series_dir=fixtures/build/linux-arm64-7
        series_pattern='^linux-image-7\.[0-9]+\.[0-9]+(\+deb[0-9]+|-[0-9]+)-arm64$'
        series_suite=unstable series_arch=arm64
        ;;
    riscv64-6.12)
        # riscv64 became an official Debian architecture with trixie (bookworm has no riscv64).
        series_dir=fixtures/build/linux-riscv64 series_pattern='^linux-image-6\.12\.[0-9]+\+deb13-riscv64$'
        series_suite=trixie series_arch=riscv64
        ;;
    *) return 1 ;;
    esac
    series_state=
    [ -z "$series_suite" ] || series_state=$(apt_state "$series_suite" "$series_arch")
    apt_private "$series_state" "$series_arch"
}

# apt_state SUITE ARCH: the private apt state folder of SUITE's lists for ARCH (an absolute path).
apt_state() { echo "$PWD/fixtures/build/apt/$1-$2"; }

# series_update: fetch the package lists apt_opts read. A private suite's into its own state
# folder (any user); the host's own lists only as root.
series_update() {
    if [ -n "$series_suite" ]; then
        apt_private_update "$series_state" "$series_suite"
    elif [ "$(id -u)" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" -qq update </dev/null
    else
        return 1
    fi
}

# apt_private [STATE [ARCH]]: sets apt_opts (options for apt-get and apt-cache) to read the private
# apt state folder STATE (an absolute path: its sources list, lists and cache), for the Debian
# architecture ARCH when given (its lists only); without STATE, the host's own sources.
apt_private() {
    # As root apt drops to _apt for downloads, which cannot write into a private folder.
    apt_opts=()
    [ "$(id -u)" = 0 ] && apt_opts+=(-o APT::Sandbox::User=root)
    if [ -n "${1:-}" ]; then
        apt_opts+=(-o "Dir::Etc::SourceList=$1/sources.list" -o Dir::Etc::SourceParts=/nonexistent
            -o "Dir::State::Lists=$1/lists" -o "Dir::Cache=$1/cache")
        [ "${2:-amd64}" = amd64 ] || apt_opts+=(-o "APT::Architecture=$2" -o "APT::Architectures=$2")
    fi
    return 0
}

# apt_private_update STATE SUITE: STATE's sources list reads SUITE (and its security suite), and
# its lists are fetched (apt checks their signatures with the host's keyring). apt_opts must be
# apt_private's for STATE. Under scripts/setup (QMPPROF_APT_SINCE, the time it started) a state
# is read once: lists fetched since then are kept, as several scripts read the same suite.
apt_private_update() {
    local state=$1 suite=$2
    mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
    (
        # Scripts run side by side under scripts/setup: one reads the lists, the others wait.
        flock 8
        since=${QMPPROF_APT_SINCE:-}
        [ -n "$since" ] && [ "$(cat "$state/updated" 2>/dev/null || echo 0)" -ge "$since" ] && exit 0
        {
            echo "deb http://deb.debian.org/debian $suite main"
            # unstable, experimental and backports have no security suite (fixes land in them)
            case "$suite" in
            unstable | experimental | *-backports) ;;
            *) echo "deb http://deb.debian.org/debian-security $suite-security main" ;;
            esac
        } >"$state/sources.list"
        rm -f "$state/updated"
        apt-get "${apt_opts[@]}" -qq update </dev/null
        date +%s >"$state/updated"
    ) 8>"$state/.lock"
}

# kernel_unpack WORK DEB RELEASE: the boot files of kernel RELEASE (vmlinuz, config, System.map)
# out of its image package DEB (downloaded into WORK) into WORK/root, where kernel_file finds
# them. Bookworm's and bullseye's linux-image-<release> holds them in /boot. Unstable's (7.x) is
# a metapackage depending, at its own version, on linux-binary-<release> (the bzImage as
# /usr/lib/modules/<release>/vmlinuz), linux-base-<release> (config and System.map beside it)
# and linux-modules-<release> (110 MB of .ko.xz, not needed): when DEB holds no vmlinuz, the
# packages it depends on are downloaded with apt_opts (but the modules) and unpacked too.
# Messages go through the caller's `say`.
kernel_unpack() {
    local work=$1 deb=$2 release=$3 version deps dep
    version=$(dpkg-deb --field "$deb" Version)
    mkdir -p "$work/root"
    _kernel_members "$work" "$deb" "$release"
    kernel_file "$work" "$release" vmlinuz >/dev/null && return 0
    deps=$(dpkg-deb --field "$deb" Depends | tr ',|' '\n\n' |
        awk -v suffix="-$release" -v pin="(= $version)" '{
            name = $1; $1 = ""; sub(/^ /, "")
            if (substr(name, length(name) - length(suffix) + 1) == suffix && $0 == pin) print name
        }')
    for dep in $deps; do
        case "$dep" in linux-modules-*) continue ;; esac # the modules: no fixture file in them
        say "downloading $dep (a dependency of ${deb##*/})"
        (cd "$work" && apt-get download -q=2 "${apt_opts[@]}" "$dep=$version" </dev/null)
        _kernel_members "$work" "$(ls "$work/${dep}_"*.deb)" "$release"
    done
}

# _kernel_members WORK DEB RELEASE: DEB's vmlinuz, config and System.map (if any) into WORK/root.
# riscv64's boot image is /boot/vmlinux-<release> (a PE/EFI Image, not an ELF), taken as vmlinuz.
_kernel_members() {
    local release_re files_re members
    release_re=$(sed 's/[.+]/\\&/g' <<<"$3")
    files_re="^\./(boot/(vmlinuz|vmlinux|config|System\.map)-$release_re|(usr/)?lib/modules/$release_re/(vmlinuz|config|System\.map))\$"
    mapfile -t members < <(dpkg-deb --fsys-tarfile "$2" | tar -t | grep -E "$files_re")
    ((${#members[@]} == 0)) || dpkg-deb --fsys-tarfile "$2" | tar -x -C "$1/root" "${members[@]}"
}

# kernel_file WORK RELEASE NAME: where kernel_unpack put NAME (vmlinuz, config or System.map).
kernel_file() {
    local path
    local paths=("boot/$3-$2" "usr/lib/modules/$2/$3" "lib/modules/$2/$3")
    [ "$3" = vmlinuz ] && paths+=("boot/vmlinux-$2")
    for path in "${paths[@]}"; do
        [ -s "$1/root/$path" ] && echo "$1/root/$path" && return 0
    done
    return 1
}

# Every package the build scripts download, once: one folder shared by them, each file under the
# name apt gives it (NAME_VERSION_ARCH.deb, an epoch's ':' as %3a).
DEBS=fixtures/build/debs
declare -A deb_got=()

# deb_get SPEC...: prints the paths (one a line) of the packages (NAME, the candidate of apt_opts'
# lists, or NAME=VERSION) in $DEBS, each downloaded unless the file there has the SHA256 those
# signed lists give. One apt-get to look them up and one to download (apt reads the lists anew at
# each start: seconds on a loaded host). Messages go through the caller's `say`.
deb_get() {
    local lines=() line uri name size hash missing=() sums=()
    # apt's lines: 'URI' FILENAME SIZE SHA256:HEX, from the lists whose signatures it checked.
    mapfile -t lines < <(apt-get download --print-uris -q=2 "${apt_opts[@]}" "$@" </dev/null || echo failed)
    ((${#lines[@]} == $#)) && [ "${lines[-1]}" != failed ] || return 1
    mkdir -p "$DEBS"
    (
        # Scripts run side by side under scripts/setup: one downloads, the other finds the file.
        flock 8
        for line in "${lines[@]}"; do
            read -r uri name size hash <<<"$line"
            [[ "$hash" == SHA256:* ]] || exit 1
            [ -e "$DEBS/$name" ] && sha256sum --quiet -c <<<"${hash#SHA256:}  $DEBS/$name" >/dev/null 2>&1 &&
                continue
            sums+=("${hash#SHA256:}  $name")
            # NAME_VERSION_ARCH.deb, an epoch's ':' written %3a
            name=${name%_*.deb}
            missing+=("${name%%_*}=$(sed 's/%3a/:/' <<<"${name#*_}")")
        done
        ((${#missing[@]})) || exit 0
        if ((${#missing[@]} > 3)); then
            say "downloading ${#missing[@]} packages"
        else
            say "downloading ${missing[*]}"
        fi
        tmp=$(mktemp -d "$DEBS/.get.XXXXXX")
        trap 'rm -rf "$tmp"' EXIT
        (cd "$tmp" && apt-get download -q=2 "${apt_opts[@]}" "${missing[@]}" </dev/null) || exit 1
        (cd "$tmp" && printf '%s\n' "${sums[@]}" | sha256sum --quiet -c) || exit 1
        mv "$tmp"/*.deb "$DEBS/"
    ) 8>"$DEBS/.lock" || return 1
    for line in "${lines[@]}"; do
        read -r uri name size hash <<<"$line"
        echo "$DEBS/$name"
    done
}

# deb_fetch SPEC...: deb_get, after reading the package lists again if it fails (empty or stale
# lists), each remembered for deb_path under the current suite and architecture.
deb_fetch() {
    local files file name
    files=$(deb_get "$@") || { series_update >&2 && files=$(deb_get "$@"); } || return 1
    for file in $files; do
        name=$(basename "$file" .deb)
        name=${name%_*}
        deb_got["$series_arch/$series_suite/${name%%_*}"]=$file
        deb_got["$series_arch/$series_suite/${name%%_*}=$(sed 's/%3a/:/' <<<"${name#*_}")"]=$file
    done
}

# kbuild_version PACKAGE VERSION: the version of the kbuild PACKAGE (read with apt_opts, for the
# host's architecture) to build against kernel headers at VERSION: VERSION itself when apt_opts'
# suites have it, else their newest of the same upstream release. kbuild's programs (modpost,
# fixdep, ...) follow the upstream release, and Debian's security suite does not keep every
# package at one revision: on 2026-11-28 bookworm-security had linux-headers-6.1.0-56-amd64 and
# -arm64 at 6.1.192-2 and linux-kbuild-6.1 only at 6.1.192-3.
kbuild_version() {
    local package=$1 version=$2 found
    found=$(apt-cache "${apt_opts[@]}" madison "$package" | awk -v up="${version%-*}-" \
        -v exact="$version" '$3 == exact {print $3; exit} index($3, up) == 1 && !any {any = $3}
        END {if (any) print any}' | head -1)
    [ -n "$found" ] || die "$package has no version of ${version%-*} in apt_opts' suites"
    [ "$found" = "$version" ] || say "$package $version is gone from apt_opts' suites: taking $found"
    echo "$found"
}

# deb_path NAME [VERSION]: the file deb_fetch got for NAME (at VERSION) in the current suite and
# architecture.
deb_path() { echo "${deb_got["$series_arch/$series_suite/$1${2:+=$2}"]:-}"; }
