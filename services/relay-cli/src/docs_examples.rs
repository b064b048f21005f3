//! The README and the pages of docs/ show commands and configuration; these
//! tests keep them true: every `relay …` command they show names a command
//! and flags the binary has, every script they run exists, and every TOML
//! block parses (a whole configuration also passes `check-config`'s checks).

use std::path::{Path, PathBuf};

use clap::CommandFactory;

use crate::cli::Cli;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The README and every page of docs/, with their text.
fn pages() -> Vec<(String, String)> {
    let mut paths = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    paths.extend(docs);
    paths.into_iter().map(|p| (p.display().to_string(), std::fs::read_to_string(&p).unwrap())).collect()
}

/// The fenced blocks of `text` in language `lang`.
fn blocks<'t>(text: &'t str, lang: &str) -> Vec<&'t str> {
    let open = format!("```{lang}\n");
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(&open) {
        let body = &rest[at + open.len()..];
        let end = body.find("\n```").map_or(body.len(), |e| e + 1);
        out.push(&body[..end]);
        rest = &body[end..];
    }
    out
}

/// Every `relay …` command in `text`: in `sh` blocks, and in inline code.
fn relay_commands(text: &str) -> Vec<String> {
    let mut found: Vec<String> = blocks(text, "sh")
        .into_iter()
        .flat_map(|b| b.lines())
        .map(|l| l.trim_start_matches("$ ").split(" #").next().unwrap_or("").trim())
        .filter(|l| {
            // The command itself, after any VAR=value assignments.
            let first = l.split_whitespace().find(|w| !w.contains('='));
            first.is_some_and(|w| w == "relay" || w.ends_with("/relay"))
        })
        .map(str::to_owned)
        .collect();
    found.extend(text.split('`').skip(1).step_by(2).filter(|c| c.starts_with("relay ")).map(str::to_owned));
    found
}

/// Whether `command` (a line that runs `relay`) names subcommands and long
/// flags the binary has; `Err` says which word is unknown.
fn known(command: &str) -> Result<(), String> {
    let words: Vec<&str> =
        command.split_whitespace().skip_while(|w| !(*w == "relay" || w.ends_with("/relay"))).skip(1).collect();
    let mut cmd = Cli::command();
    let mut args: Vec<clap::Arg> = cmd.get_arguments().cloned().collect();
    let mut words = words.into_iter();
    while let Some(w) = words.next() {
        if w.contains('|')
            || w.contains('…')
            || w.starts_with('<')
            || w.chars().all(|c| c.is_ascii_uppercase() || c == '_')
        {
            // A placeholder or a choice (`list|show`, `NAME`, `…`): the rest is prose.
            break;
        }
        if let Some(flag) = w.strip_prefix("--") {
            let (name, inline_value) = flag.split_once('=').map_or((flag, false), |(n, _)| (n, true));
            if name == "help" || name == "version" {
                continue;
            }
            let Some(arg) = args.iter().find(|a| a.get_long() == Some(name)) else {
                return Err(format!("`{command}`: no flag --{name}"));
            };
            if arg.get_action().takes_values() && !inline_value {
                words.next();
            }
            continue;
        }
        if w.starts_with('-') {
            continue;
        }
        match cmd.find_subcommand(w).cloned() {
            Some(sub) => {
                args.extend(sub.get_arguments().cloned());
                cmd = sub;
            }
            // A value (a name, an id) of a command that takes no more subcommands.
            None if cmd.get_subcommands().next().is_none() => continue,
            None => return Err(format!("`{command}`: no command {w:?} under `{}`", cmd.get_name())),
        }
    }
    Ok(())
}

#[test]
fn every_relay_command_the_docs_show_is_one_the_binary_has() {
    let mut checked = 0;
    for (page, text) in pages() {
        for command in relay_commands(&text) {
            if let Err(why) = known(&command) {
                panic!("{page}: {why}");
            }
            checked += 1;
        }
    }
    assert!(checked > 30, "only {checked} commands found: has the docs' spelling changed?");
}

#[test]
fn the_check_itself_catches_a_command_or_flag_that_does_not_exist() {
    assert!(known("relay intents list --state dead").is_ok());
    assert!(known("relay --config relay.toml check-config --explain order-placed").is_ok());
    assert!(known("relay intents lst").is_err());
    assert!(known("relay intents list --stat dead").is_err());
}

#[test]
fn every_script_the_docs_run_exists() {
    for (page, text) in pages() {
        for script in text.split(|c: char| c.is_whitespace() || c == '`' || c == '(' || c == ')') {
            let script = script.trim_end_matches(['.', ',', ':', ';']);
            if script.starts_with("scripts/") && script.ends_with(".sh") {
                assert!(root().join(script).exists(), "{page}: {script} does not exist");
            }
        }
    }
}

#[test]
fn every_toml_block_of_the_docs_parses_and_a_whole_configuration_is_valid() {
    let mut whole = 0;
    for (page, text) in pages() {
        for block in blocks(&text, "toml") {
            if let Err(e) = toml::from_str::<toml::Table>(block) {
                panic!("{page}: a TOML block does not parse: {e}\n{block}");
            }
            if block.contains("[consumer]") || block.starts_with("consumer =") {
                relay_core::RelayConfig::from_toml(block).unwrap_or_else(|e| panic!("{page}: {e}\n{block}"));
                whole += 1;
            }
        }
    }
    // The example configuration the README tours is whole, and checked too.
    let example = std::fs::read_to_string(root().join("relay.example.toml")).unwrap();
    relay_core::RelayConfig::from_toml(&example).unwrap();
    let _ = whole;
}
