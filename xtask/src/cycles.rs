//! `cargo xtask cycles`: no two sibling modules of a crate depend on each other, directly
//! or through a chain. A module depends on a sibling when any file of its subtree names
//! a path inside the sibling (`crate::…`, `super::…`, `self::…`, or an item the crate
//! root or another module re-exports from it). A child naming its ancestors is not a
//! cycle (that is what `super` is for); test-only modules (`#[cfg(test)] mod …`) are left
//! out, since tests may use everything.
//!
//! The scan is lexical (std only, like the rest of xtask): comments, strings and
//! character literals are skipped, `use` trees are expanded, and re-exports (`pub use`)
//! are followed, which is what the workspace's code needs; macros' bodies are read as
//! plain tokens.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Where each crate of the workspace starts: its root file, relative to the workspace.
fn crate_roots(root: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    let mut dirs = vec![root.to_path_buf(), root.join("xtask")];
    for parent in ["crates", "bindings"] {
        if let Ok(entries) = std::fs::read_dir(root.join(parent)) {
            let mut found: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
            found.sort();
            dirs.extend(found);
        }
    }
    for dir in dirs {
        for file in ["src/lib.rs", "src/main.rs"] {
            if dir.join(file).is_file() {
                roots.push(dir.join(file));
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(root.join("examples")) {
        let mut found: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path().join("main.rs"))
            .filter(|p| p.is_file())
            .collect();
        found.sort();
        roots.extend(found);
    }
    roots
}

/// `cargo xtask cycles`: checks every crate of the workspace; the error lists each cycle
/// with the references that make it.
pub fn cycles() -> Result<(), String> {
    let root = crate::cmd::root();
    let mut report = String::new();
    let mut crates = 0;
    for file in crate_roots(&root) {
        let krate = Crate::load(&file)?;
        crates += 1;
        for cycle in krate.cycles() {
            let _ = writeln!(
                report,
                "{}: {}",
                file.strip_prefix(&root).unwrap_or(&file).display(),
                cycle
            );
        }
    }
    if report.is_empty() {
        println!("cycles: no module cycle in {crates} crates");
        Ok(())
    } else {
        Err(format!("module cycles:\n{report}"))
    }
}

/// A module's path from its crate's root (`[]` is the root).
type ModPath = Vec<String>;

/// One crate's modules, their re-exports and the paths each module's files name.
#[derive(Debug, Default)]
pub struct Crate {
    /// Every (non-test) module, with the file that holds it.
    modules: BTreeMap<ModPath, PathBuf>,
    /// `pub use` items: (module, name) to the absolute path they name.
    reexports: BTreeMap<(ModPath, String), Vec<String>>,
    /// (module the reference is in, absolute path it names).
    references: Vec<(ModPath, Vec<String>)>,
}

impl Crate {
    /// Reads the crate whose root file is `root`, following `mod` declarations.
    pub fn load(root: &Path) -> Result<Crate, String> {
        let mut krate = Crate::default();
        let mut files = Vec::new();
        let mut pending = vec![(Vec::new(), root.to_path_buf())];
        while let Some((path, file)) = pending.pop() {
            let text = std::fs::read_to_string(&file)
                .map_err(|e| format!("reading {}: {e}", file.display()))?;
            // Children of `lib.rs`, `main.rs` and `mod.rs` live beside them; of `x.rs`,
            // in `x/`.
            let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
            let dir = if path.is_empty() || stem == "mod" {
                file.parent().map(Path::to_path_buf).unwrap_or_default()
            } else {
                file.with_extension("")
            };
            krate.modules.insert(path.clone(), file.clone());
            for child in krate.scan(&path, &text) {
                let name = child.last().cloned().unwrap_or_default();
                let a = dir.join(format!("{name}.rs"));
                let b = dir.join(&name).join("mod.rs");
                let found = if a.is_file() { a } else { b };
                if !found.is_file() {
                    return Err(format!(
                        "{}: `mod {name};` has no file ({} or {})",
                        file.display(),
                        dir.join(format!("{name}.rs")).display(),
                        dir.join(&name).join("mod.rs").display()
                    ));
                }
                pending.push((child, found));
            }
            files.push((path, text));
        }
        // The first pass found the modules; the second resolves bare paths against them.
        krate.rescan(&files);
        Ok(krate)
    }

    /// Reads every file again, now that every module is known.
    fn rescan(&mut self, files: &[(ModPath, String)]) {
        self.references.clear();
        self.reexports.clear();
        for (path, text) in files {
            self.scan(path, text);
        }
    }

    /// Builds a crate from in-memory files (module path, source): for tests.
    #[cfg(test)]
    fn from_sources(files: &[(&[&str], &str)]) -> Crate {
        let mut krate = Crate::default();
        let files: Vec<(ModPath, String)> = files
            .iter()
            .map(|(path, text)| {
                (
                    path.iter().map(|s| s.to_string()).collect(),
                    text.to_string(),
                )
            })
            .collect();
        for (path, text) in &files {
            krate
                .modules
                .insert(path.clone(), PathBuf::from(path.join("/")));
            krate.scan(path, text);
        }
        krate.rescan(&files);
        krate
    }

    /// Reads one file of module `path`: records its references, re-exports and inline
    /// modules, and returns the out-of-line child modules it declares.
    fn scan(&mut self, path: &ModPath, text: &str) -> Vec<ModPath> {
        let tokens = tokens(text);
        let mut children = Vec::new();
        // Inline modules open at a brace depth: (depth, name).
        let mut inline: Vec<(usize, String)> = Vec::new();
        let mut depth = 0usize;
        let mut i = 0;
        let here = |inline: &[(usize, String)]| -> ModPath {
            let mut p = path.clone();
            p.extend(inline.iter().map(|(_, n)| n.clone()));
            p
        };
        while i < tokens.len() {
            let t = tokens[i].as_str();
            match t {
                "{" => depth += 1,
                "}" => {
                    depth = depth.saturating_sub(1);
                    if inline.last().is_some_and(|(d, _)| *d == depth) {
                        inline.pop();
                    }
                }
                "#" if is_cfg_test(&tokens, i) => {
                    // Skip the attribute and the test-only item it marks.
                    i = skip_item(&tokens, skip_attribute(&tokens, i));
                    continue;
                }
                "mod" if i + 2 < tokens.len() && is_ident(&tokens[i + 1]) => {
                    let mut child = here(&inline);
                    child.push(tokens[i + 1].clone());
                    match tokens[i + 2].as_str() {
                        ";" => children.push(child),
                        "{" => {
                            self.modules.entry(child).or_default();
                            inline.push((depth, tokens[i + 1].clone()));
                            depth += 1;
                            i += 3;
                            continue;
                        }
                        _ => {}
                    }
                }
                "use" => {
                    let public = i > 0 && (tokens[i - 1] == "pub" || tokens[i - 1] == ")");
                    let end = tokens[i..]
                        .iter()
                        .position(|t| t == ";")
                        .map_or(tokens.len(), |p| i + p);
                    let module = here(&inline);
                    let mut trees = Vec::new();
                    use_tree(&tokens[i + 1..end], Vec::new(), &mut trees);
                    for (segments, alias) in trees {
                        let Some(abs) = self.absolute(&module, &segments) else {
                            continue;
                        };
                        if public && let Some(name) = alias {
                            self.reexports.insert((module.clone(), name), abs.clone());
                        }
                        self.references.push((module.clone(), abs));
                    }
                    i = end + 1;
                    continue;
                }
                "crate" | "super" | "self"
                    if tokens.get(i + 1).is_some_and(|n| n == "::")
                        && !(i > 0 && tokens[i - 1] == "::") =>
                {
                    let mut segments = vec![t.to_string()];
                    let mut j = i + 1;
                    while j + 1 < tokens.len() && tokens[j] == "::" && is_ident(&tokens[j + 1]) {
                        segments.push(tokens[j + 1].clone());
                        j += 2;
                    }
                    let module = here(&inline);
                    if let Some(abs) = self.absolute(&module, &segments) {
                        self.references.push((module, abs));
                    }
                    i = j;
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
        children
    }

    /// `segments` as named from `module`, made absolute; `None` for another crate's path.
    fn absolute(&self, module: &ModPath, segments: &[String]) -> Option<Vec<String>> {
        let mut abs = match segments.first().map(String::as_str) {
            Some("crate") => Vec::new(),
            Some("self") => module.clone(),
            Some("super") => module.clone(),
            // A bare path names a child module of `module` (or another crate).
            Some(_) => {
                let mut child = module.clone();
                child.push(segments[0].clone());
                if !self.modules.contains_key(&child) {
                    return None;
                }
                module.clone()
            }
            None => return None,
        };
        let mut rest = segments;
        if matches!(segments[0].as_str(), "crate" | "self") {
            rest = &segments[1..];
        }
        for seg in rest {
            if seg == "super" {
                abs.pop();
            } else {
                abs.push(seg.clone());
            }
        }
        Some(abs)
    }

    /// The module an absolute path lands in, following re-exports.
    fn resolve(&self, path: &[String]) -> ModPath {
        let mut path = path.to_vec();
        for _ in 0..8 {
            let mut module: ModPath = Vec::new();
            let mut followed = false;
            for (k, seg) in path.iter().enumerate() {
                let mut next = module.clone();
                next.push(seg.clone());
                if self.modules.contains_key(&next) {
                    module = next;
                } else if let Some(target) = self.reexports.get(&(module.clone(), seg.clone())) {
                    let mut p = target.clone();
                    p.extend_from_slice(&path[k + 1..]);
                    if p == path {
                        return module;
                    }
                    path = p;
                    followed = true;
                    break;
                } else {
                    return module;
                }
            }
            if !followed {
                return module;
            }
        }
        Vec::new()
    }

    /// The dependencies between sibling modules: (parent, from, to) with an example
    /// reference each.
    fn edges(&self) -> BTreeMap<(ModPath, String, String), String> {
        let mut edges = BTreeMap::new();
        for (from, path) in &self.references {
            let to = self.resolve(path);
            let k = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if k < from.len() && k < to.len() {
                let example = format!("{} names {}", show(from), path.join("::"));
                edges
                    .entry((from[..k].to_vec(), from[k].clone(), to[k].clone()))
                    .or_insert(example);
            }
        }
        edges
    }

    /// Each cycle among sibling modules, described with the references that close it.
    pub fn cycles(&self) -> Vec<String> {
        let edges = self.edges();
        let mut by_parent: BTreeMap<ModPath, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
        for (parent, from, to) in edges.keys() {
            by_parent
                .entry(parent.clone())
                .or_default()
                .entry(from.clone())
                .or_default()
                .insert(to.clone());
        }
        let mut found = Vec::new();
        for (parent, graph) in &by_parent {
            for component in strongly_connected(graph) {
                let mut text = format!(
                    "modules {} under {} depend on each other:",
                    component.join(", "),
                    show(parent)
                );
                for ((p, from, to), example) in &edges {
                    if p == parent && component.contains(from) && component.contains(to) {
                        let _ = write!(text, "\n    {from} -> {to} ({example})");
                    }
                }
                found.push(text);
            }
        }
        found
    }
}

/// A module path as `crate::a::b`.
fn show(path: &[String]) -> String {
    std::iter::once("crate")
        .chain(path.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("::")
}

/// The strongly connected components with more than one node (Tarjan's algorithm).
fn strongly_connected(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        if let Some(next) = s.graph.get(v) {
            for w in next {
                if !s.index.contains_key(w.as_str()) {
                    visit(s, w);
                    let lw = s.low[w.as_str()];
                    let lv = s.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if s.on_stack.contains(w.as_str()) {
                    let iw = s.index[w.as_str()];
                    let lv = s.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// Expands a `use` tree (the tokens after `use`, before `;`) into (path, name bound).
fn use_tree(tokens: &[String], prefix: Vec<String>, out: &mut Vec<(Vec<String>, Option<String>)>) {
    let mut path = prefix;
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i].as_str();
        match t {
            "::" => {}
            "{" => {
                // Split the group at top-level commas.
                let mut depth = 0;
                let mut start = i + 1;
                let mut j = i + 1;
                while j < tokens.len() {
                    match tokens[j].as_str() {
                        "{" => depth += 1,
                        "}" if depth == 0 => break,
                        "}" => depth -= 1,
                        "," if depth == 0 => {
                            use_tree(&tokens[start..j], path.clone(), out);
                            start = j + 1;
                        }
                        _ => {}
                    }
                    j += 1;
                }
                use_tree(&tokens[start..j.min(tokens.len())], path.clone(), out);
                return;
            }
            "*" => {
                out.push((path, None));
                return;
            }
            "as" => {
                let alias = tokens.get(i + 1).filter(|a| *a != "_").cloned();
                out.push((path, alias));
                return;
            }
            _ if is_ident(t) => path.push(t.to_string()),
            _ => {}
        }
        i += 1;
    }
    if let Some(last) = path.last().cloned() {
        // `use a::b::{self}` binds `b`.
        if last == "self" {
            path.pop();
        }
        let name = path.last().cloned();
        out.push((path, name));
    }
}

/// Whether the attribute starting at `tokens[i]` (`#`) is `#[cfg(test)]`.
fn is_cfg_test(tokens: &[String], i: usize) -> bool {
    let want = ["#", "[", "cfg", "(", "test", ")", "]"];
    tokens.len() >= i + want.len()
        && tokens[i..i + want.len()]
            .iter()
            .zip(want)
            .all(|(a, b)| a == b)
}

/// The index after the attribute starting at `tokens[i]`.
fn skip_attribute(tokens: &[String], i: usize) -> usize {
    let mut depth = 0;
    for (j, t) in tokens.iter().enumerate().skip(i + 1) {
        match t.as_str() {
            "[" => depth += 1,
            "]" => {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
    }
    tokens.len()
}

/// The index after the item starting at `tokens[i]` (its further attributes included):
/// up to its `;` or its closing brace.
fn skip_item(tokens: &[String], mut i: usize) -> usize {
    while tokens.get(i).is_some_and(|t| t == "#") {
        i = skip_attribute(tokens, i);
    }
    let mut depth = 0;
    while i < tokens.len() {
        match tokens[i].as_str() {
            ";" if depth == 0 => return i + 1,
            "{" => depth += 1,
            "}" => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    i
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// Rust source as identifiers, `::` and single punctuation characters; comments,
/// strings, characters and numbers dropped (lifetimes read as their name).
fn tokens(text: &str) -> Vec<String> {
    let c: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == 'r'
            && matches!(c.get(i + 1), Some('#' | '"'))
            && raw_string(&c, i + 1).is_some()
        {
            i = raw_string(&c, i + 1).unwrap_or(c.len());
        } else if ch == 'b' && c.get(i + 1) == Some(&'r') && raw_string(&c, i + 2).is_some() {
            i = raw_string(&c, i + 2).unwrap_or(c.len());
        } else if ch == '"' || (ch == 'b' && c.get(i + 1) == Some(&'"')) {
            i += if ch == 'b' { 2 } else { 1 };
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if ch == '\'' {
            if c.get(i + 1) == Some(&'\\') {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1; // a lifetime: its name follows as an identifier
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(c[start..i].iter().collect());
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == '.') {
                if c[i] == '.' && c.get(i + 1) == Some(&'.') {
                    break;
                }
                i += 1;
            }
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push("::".into());
            i += 2;
        } else {
            out.push(ch.to_string());
            i += 1;
        }
    }
    out
}

/// The index after a raw string whose `#`s or quote start at `c[i]`, if one starts there.
fn raw_string(c: &[char], mut i: usize) -> Option<usize> {
    let mut hashes = 0;
    while c.get(i) == Some(&'#') {
        hashes += 1;
        i += 1;
    }
    if c.get(i) != Some(&'"') {
        return None;
    }
    i += 1;
    while i < c.len() {
        if c[i] == '"' && (0..hashes).all(|h| c.get(i + 1 + h) == Some(&'#')) {
            return Some(i + 1 + hashes);
        }
        i += 1;
    }
    Some(c.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_siblings_naming_each_other_are_a_cycle() {
        let k = Crate::from_sources(&[
            (&[], "mod a; mod b;"),
            (&["a"], "use crate::b::B; pub struct A;"),
            (&["b"], "pub struct B(super::a::A);"),
        ]);
        let cycles = k.cycles();
        assert_eq!(cycles.len(), 1, "{cycles:?}");
        assert!(
            cycles[0].contains("modules a, b under crate"),
            "{}",
            cycles[0]
        );
    }

    #[test]
    fn a_child_naming_its_parent_is_not_a_cycle() {
        let k = Crate::from_sources(&[
            (&[], "mod a; pub use a::A;"),
            (&["a"], "mod inner; pub struct A;"),
            (&["a", "inner"], "use super::A; impl super::A { fn f() {} }"),
        ]);
        assert!(k.cycles().is_empty(), "{:?}", k.cycles());
    }

    #[test]
    fn a_re_export_of_the_root_is_followed_to_its_module() {
        let k = Crate::from_sources(&[
            (&[], "mod a; mod b; pub use a::A; pub use b::{B as Bee};"),
            (&["a"], "use crate::{Bee}; pub struct A;"),
            (&["b"], "pub struct B; impl crate::A { }"),
        ]);
        assert_eq!(k.cycles().len(), 1, "{:?}", k.cycles());
    }

    #[test]
    fn a_chain_of_three_is_one_cycle_and_test_modules_are_left_out() {
        let k = Crate::from_sources(&[
            (&[], "mod a; mod b; mod c; mod d;"),
            (&["a"], "use crate::b::X;"),
            (&["b"], "use crate::c::X;"),
            (&["c"], "fn f() { crate::a::g(); }"),
            (
                &["d"],
                "#[cfg(test)]\nmod tests { use crate::a::X; }\nuse crate::a::Y;",
            ),
        ]);
        let cycles = k.cycles();
        assert_eq!(cycles.len(), 1, "{cycles:?}");
        assert!(cycles[0].contains("modules a, b, c under"), "{}", cycles[0]);
        // `d` names `a` outside its tests, `a` never names `d`: no cycle.
        let k = Crate::from_sources(&[
            (&[], "mod a; mod d;"),
            (
                &["a"],
                "#[cfg(test)] use crate::d::T; // crate::d::U in a comment\nconst S: &str = \"crate::d::V\";",
            ),
            (&["d"], "use crate::a::Y;"),
        ]);
        assert!(k.cycles().is_empty(), "{:?}", k.cycles());
    }

    #[test]
    fn the_workspace_has_no_module_cycle() {
        // The same check as `cargo xtask cycles`, so the test matrix keeps it true too.
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut all = Vec::new();
        for file in crate_roots(&root) {
            all.extend(Crate::load(&file).expect("the crate reads").cycles());
        }
        assert!(all.is_empty(), "module cycles:\n{}", all.join("\n"));
    }
}
