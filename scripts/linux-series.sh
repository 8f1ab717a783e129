# Sourced by scripts/fetch-linux, scripts/fetch-linux-dbg and scripts/build-linux-guest: the
# Debian kernel series the tests boot, where each one's files go and which suite ships it.
#
#   series  folder                      image package                        suite
#   6.12    fixtures/build/linux        linux-image-6.12.N+deb12-amd64       bookworm (the host's)
#   6.1     fixtures/build/linux-6.1    linux-image-6.1.0-N-amd64            bookworm
#   5.10    fixtures/build/linux-5.10   linux-image-5.10.0-N-amd64           bullseye
#   7       fixtures/build/linux-7      linux-image-7.M.N+debNN-amd64        unstable
#
# Only the generic amd64 flavour (not -cloud-amd64, -rt-amd64). A suite other than the host's is
# read through a private apt state in <folder>/.apt: a sources list, package lists and a cache of
# its own (apt checks the suite's signatures with the host's debian-archive-keyring as for any
# source). The host's apt sources and lists are never changed by it, and nothing from another
# suite is installed on the host: packages are only downloaded and unpacked into fixtures/build.

LINUX_SERIES="6.12 6.1 5.10 7"

# series_use SERIES: sets series_dir, series_pattern (an ERE for the image package's name),
# series_suite (empty: the host's own sources) and apt_opts (options for apt-get and apt-cache).
series_use() {
    series_suite=
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
    *) return 1 ;;
    esac
    # As root apt drops to _apt for downloads, which cannot write into a private folder.
    apt_opts=()
    [ "$(id -u)" = 0 ] && apt_opts+=(-o APT::Sandbox::User=root)
    if [ -n "$series_suite" ]; then
        local state="$PWD/$series_dir/.apt"
        apt_opts+=(-o "Dir::Etc::SourceList=$state/sources.list" -o Dir::Etc::SourceParts=/nonexistent
            -o "Dir::State::Lists=$state/lists" -o "Dir::Cache=$state/cache")
    fi
    return 0
}

# series_update: fetch the package lists apt_opts read. A private suite's into its own state
# folder (any user); the host's own lists only as root.
series_update() {
    if [ -n "$series_suite" ]; then
        local state="$PWD/$series_dir/.apt"
        mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
        {
            echo "deb http://deb.debian.org/debian $series_suite main"
            # unstable has no security suite (fixes land in unstable itself)
            [ "$series_suite" = unstable ] ||
                echo "deb http://deb.debian.org/debian-security $series_suite-security main"
        } >"$state/sources.list"
        apt-get "${apt_opts[@]}" -qq update </dev/null
    elif [ "$(id -u)" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" -qq update </dev/null
    else
        return 1
    fi
}
