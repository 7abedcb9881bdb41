#!/usr/bin/env bash
# Edit the patch series as commits of a git tree, then write the series back.
#
#   clients/llama.cpp/patch/refresh.sh init DIR     DIR: the pinned llama.cpp tree as a git repository,
#                                                   one commit per patch of the series (subject: the
#                                                   patch's name, e.g. 0002-remap-op), on a base
#                                                   commit tagged moecached-base
#   clients/llama.cpp/patch/refresh.sh export DIR   write every commit after moecached-base back as
#                                                   patch/SUBJECT.patch (the diff of that commit);
#                                                   series files no commit names are removed
#
# In between, edit DIR with git: amend a patch's commit (git rebase -i moecached-base, "edit"),
# add a commit for a new patch (subject NNNN-name, numbered after the one it follows), and so on.
# The sdist comes from build.sh's cache (DIR/dl of $MOECACHED_LLAMA_CACHE, else
# ~/.cache/moecached-llama; build.sh downloads it). DIR must not exist for init, and must not be
# inside the clone. Check the result with clients/llama.cpp/build.sh.
set -euo pipefail
shopt -s nullglob
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
cmd=${1:-}; dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ] || { [ "$cmd" != init ] && [ "$cmd" != export ]; }; then
    sed -n '2,17p' "$0"; exit 2
fi
git_() { git -C "$dir" -c user.name=moecached -c user.email=moecached@localhost -c core.autocrlf=false "$@"; }
case "$cmd" in
init)
    [ -e "$dir" ] && { echo "refresh.sh: $dir exists; give a new directory" >&2; exit 2; }
    mkdir -p "$dir"; dir=$(cd "$dir" && pwd)
    case "$dir/" in "$ROOT"/*) echo "refresh.sh: $dir is inside the clone ($ROOT)" >&2; rmdir "$dir"; exit 2 ;; esac
    ver=$(sed -n 's/^PIN_VERSION=//p' "$HERE/../build.sh")
    sdist=${MOECACHED_LLAMA_CACHE:-$HOME/.cache/moecached-llama}/dl/llama_cpp_python-$ver.tar.gz
    [ -f "$sdist" ] || { echo "refresh.sh: no $sdist (clients/llama.cpp/build.sh downloads it)" >&2; exit 1; }
    tar -xzf "$sdist" -C "$dir" --strip-components=3 "llama_cpp_python-$ver/vendor/llama.cpp"
    rm -f "$dir/.git"
    git_ init -q
    git_ add -A -f
    git_ commit -q -m "llama.cpp of llama-cpp-python $ver"
    git_ tag moecached-base
    for p in "$HERE"/*.patch; do
        git_ apply --whitespace=nowarn "$p"
        git_ add -A -f
        git_ commit -q -m "$(basename "$p" .patch)"
    done
    git_ log --oneline moecached-base..HEAD
    ;;
export)
    dir=$(cd "$dir" && pwd)
    mapfile -t commits < <(git_ rev-list --reverse moecached-base..HEAD)
    written=()
    for c in "${commits[@]}"; do
        name=$(git_ log -1 --format=%s "$c")
        case "$name" in
            [0-9][0-9][0-9][0-9]-*) ;;
            *) echo "refresh.sh: commit $c: subject '$name' is not a patch name (NNNN-name)" >&2; exit 1 ;;
        esac
        git_ diff --no-color --no-renames --no-ext-diff "$c^" "$c" > "$HERE/$name.patch"
        written+=("$name.patch")
    done
    for p in "$HERE"/*.patch; do
        keep=0
        for w in "${written[@]}"; do [ "$(basename "$p")" = "$w" ] && keep=1; done
        [ "$keep" = 1 ] || { echo "refresh.sh: removing $(basename "$p") (no commit names it)" >&2; rm -f "$p"; }
    done
    printf '%s\n' "${written[@]}"
    ;;
esac
